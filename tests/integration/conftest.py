"""Fixtures that train: the tiny target and a KD student, each built once per session through the real CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.recipe_runs import TINY_MODEL, data_overrides, fit, kd_override, merge, save_random_target, trainer_overrides
from tests.shared_fixtures import shared_folder


@pytest.fixture(scope="session")
def tiny_target(tiny_corpus, tmp_path_factory):
    """A 2-layer, hidden-64 Llama trained for a few hundred steps by recipes/quickstart/tiny_target.yaml."""

    def build(run: Path) -> None:
        override = merge(
            trainer_overrides(run, max_steps=300, every_n=300),
            data_overrides(tiny_corpus),
            {
                "model": {
                    "init_args": {
                        "tokenizer": tiny_corpus.tokenizer_dir,
                        "export_dir": str(run / "model"),
                        **TINY_MODEL,
                        "optim": {"lr": 0.005, "warmup_steps": 20},
                    }
                }
            },
        )
        fit("quickstart/tiny_target.yaml", override, run)

    return shared_folder(tmp_path_factory, "tiny_target", build) / "model"


@pytest.fixture(scope="session")
def kd_student(tiny_corpus, tiny_target, tmp_path_factory):
    """A 1-layer student distilled from the tiny target by recipes/quickstart/kd.yaml; returns (export dir, run dir)."""

    def build(run: Path) -> None:
        fit("quickstart/kd.yaml", kd_override(run, tiny_corpus, tiny_target, max_steps=60, every_n=30), run)

    run = shared_folder(tmp_path_factory, "kd_student", build)
    return run / "student", run


@pytest.fixture(scope="session")
def random_target(tiny_corpus, tmp_path_factory) -> Path:
    """A random 2-layer Llama with the tiny corpus' tokenizer saved beside it (no training: fast)."""

    def build(folder: Path) -> None:
        save_random_target(folder / "model", tiny_corpus.tokenizer_dir)

    return shared_folder(tmp_path_factory, "random_target", build) / "model"
