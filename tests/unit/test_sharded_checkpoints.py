"""trainer/checkpoints/sharded.py in one process (a stand-in strategy whose collectives are no-ops): a sharded folder
is published under its name only once written, with its marker; a save that fails leaves the previous folder as it
was; ``--ckpt_path last`` leaves out folders without the marker and cleans up partial ones. The collective timeout
option reaches the strategy. The 2-process runs with a rank that dies are in tests/integration/test_rank_faults.py."""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest

from tests.recipe_runs import RECIPES
from trainer.checkpoints import sharded
from trainer.checkpoints.sharded import (
    MARKER,
    complete_last_checkpoints,
    partial_folder,
    read_marker,
    save_folder_atomically,
)
from trainer.interface.errors import RecipeError
from trainer.training.recipe import DEFAULT_COLLECTIVE_TIMEOUT_S, _set_collective_timeout, parse_recipe


class OneRank:
    """The strategy calls of save_folder_atomically, for one process standing for rank 0 of ``world_size``."""

    is_global_zero = True

    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self.barriers: list[str] = []

    def broadcast(self, obj):
        return obj

    def barrier(self, name: str | None = None) -> None:
        self.barriers.append(str(name))


def _writer(files: dict[str, str]):
    def write(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)

    return write


def _contents(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir() if p.name != MARKER}


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_folder_is_published_whole_and_replaces_the_previous_one(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(sharded, "_exchange", lambda a, b: False)
    target = tmp_path / "last.ckpt"
    strategy = OneRank()
    save_folder_atomically(strategy, target, 2, _writer({"rank0": "a2", "rank1": "b2"}))
    assert _contents(target) == {"rank0": "a2", "rank1": "b2"}
    assert read_marker(target) == {"step": 2, "world_size": 2}
    save_folder_atomically(strategy, target, 4, _writer({"rank0": "a4", "rank1": "b4"}))
    assert _contents(target) == {"rank0": "a4", "rank1": "b4"}
    assert read_marker(target) == {"step": 4, "world_size": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert strategy.barriers == 2 * [
        "draftsmith_sharded_save_start",
        "draftsmith_sharded_save_written",
        "draftsmith_sharded_save_published",
    ]


def test_a_save_that_fails_leaves_the_previous_folder_and_the_next_save_cleans_up(tmp_path):
    target = tmp_path / "last.ckpt"
    save_folder_atomically(OneRank(), target, 2, _writer({"rank0": "a2"}))

    def fails(folder: Path) -> None:
        _writer({"rank0": "half"})(folder)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        save_folder_atomically(OneRank(), target, 4, fails)
    assert _contents(target) == {"rank0": "a2"} and read_marker(target)["step"] == 2
    assert partial_folder(target).is_dir() and read_marker(partial_folder(target)) is None
    save_folder_atomically(OneRank(), target, 6, _writer({"rank0": "a6"}))
    assert _contents(target) == {"rank0": "a6"} and not partial_folder(target).exists()


def test_resume_leaves_out_folders_without_the_marker_and_cleans_up_partial_ones(tmp_path, caplog):
    complete = tmp_path / "last.ckpt"
    save_folder_atomically(OneRank(), complete, 4, _writer({"rank0": "a4"}))
    unmarked = tmp_path / "last-v1.ckpt"  # a folder written without a marker (by another tool, or before markers)
    _writer({"rank0": "x"})(unmarked)
    single = tmp_path / "last-v2.ckpt"
    single.write_text("a single-file checkpoint")
    half = partial_folder(tmp_path / "epoch=2-step=6.ckpt")  # a save a dead rank left
    _writer({"rank0": "a6"})(half)
    finished = partial_folder(tmp_path / "epoch=3-step=8.ckpt")  # finished, interrupted between its two renames
    _writer({"rank0": "a8"})(finished)
    (finished / MARKER).write_text('{"step": 8, "world_size": 2}')
    swapped = partial_folder(complete)  # the previous last.ckpt, swapped out by a save that then ended
    _writer({"rank0": "a2"})(swapped)
    (swapped / MARKER).write_text('{"step": 2, "world_size": 2}')

    found = {str(complete), str(unmarked), str(single)}
    with caplog.at_level(logging.INFO, logger="trainer.checkpoints.sharded"):
        kept = complete_last_checkpoints(found, tmp_path)
    assert kept == {str(complete), str(single)}
    assert not half.exists() and not swapped.exists() and not finished.exists()
    assert _contents(tmp_path / "epoch=3-step=8.ckpt") == {"rank0": "a8"}
    assert _contents(complete) == {"rank0": "a4"} and unmarked.is_dir()  # nothing visible is removed
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 3, warnings
    assert any(w.startswith(f"ignoring {half}: a checkpoint folder without {MARKER}") for w in warnings)
    assert any(w.startswith(f"publishing {finished} as epoch=3-step=8.ckpt") for w in warnings)
    assert any(w.startswith(f"--ckpt_path last: ignoring {unmarked}: a checkpoint folder without") for w in warnings)


def test_the_collective_timeout_reaches_the_strategy_and_is_a_recipe_key():
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)
    _set_collective_timeout(trainer, 20.0)
    assert trainer.strategy._timeout == timedelta(seconds=20)
    with pytest.raises(RecipeError, match="collective_timeout_s: must be a positive number of seconds, got 0"):
        _set_collective_timeout(trainer, 0.0)
    recipe = [str(RECIPES / "quickstart/kd.yaml")]
    assert parse_recipe(recipe).collective_timeout_s == DEFAULT_COLLECTIVE_TIMEOUT_S
    assert parse_recipe(recipe, ["--collective_timeout_s", "45"]).collective_timeout_s == 45.0
