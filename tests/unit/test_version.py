"""One version everywhere: ``trainer.__version__`` is what ``draftsmith --version`` prints, what the installed
package's metadata says, what the changelog's top entry names and what an export records
(docs/developer/releasing.md); the changelog's headings are versions with dates, newest first."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

import trainer
from tests.helpers import tiny_llama
from trainer.cli import main as draftsmith
from trainer.export.cli import export
from trainer.methods.medusa import kind as medusa_kind
from trainer.methods.medusa.module import MedusaConfig, MedusaDrafter
from trainer.training.fingerprint import (
    EXPORT_RECORD,
    EXPORT_VERSION_KEY,
    export_record,
    export_version,
    fingerprint,
    write_export_record,
)

REPO = Path(__file__).resolve().parents[2]
CHANGELOG = REPO / "CHANGELOG.md"
VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")
HEADING = re.compile(r"^## (\d+)\.(\d+)\.(\d+) \((\d{4}-\d{2}-\d{2})\)(: \S.*)?$")


def changelog_headings() -> list[str]:
    return [line for line in CHANGELOG.read_text(encoding="utf-8").splitlines() if line.startswith("## ")]


def test_the_version_is_three_numbers():
    assert VERSION.match(trainer.__version__), trainer.__version__


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_draftsmith_version_prints_the_version(flag, capsys):
    assert draftsmith([flag]) == 0
    assert capsys.readouterr().out == f"draftsmith {trainer.__version__}\n"


def test_the_command_prints_it_without_importing_torch_or_lightning():
    code = (
        "import sys; from trainer.cli import main; status = main(['--version']); "
        "heavy = [m for m in ('torch', 'lightning', 'transformers') if m in sys.modules]; "
        "print(status, heavy)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [f"draftsmith {trainer.__version__}", "0 []"]


def test_the_usage_lists_version(capsys):
    assert draftsmith(["--help"]) == 0
    assert "--version" in capsys.readouterr().out


def test_the_package_metadata_is_the_version():
    installed = importlib.metadata.version("draftsmith")
    assert installed == trainer.__version__, (
        f"the installed draftsmith says {installed}, trainer/__init__.py {trainer.__version__}: the editable install "
        "predates the version; reinstall it (pip install -e . --no-deps)"
    )


def test_pyproject_reads_the_version_from_the_package():
    text = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text
    assert re.search(r'^version = \{ ?attr = "trainer.__version__" ?\}$', text, re.M), "[tool.setuptools.dynamic]"
    assert not re.search(r'^version = "', text, re.M), "a second, static version in pyproject.toml"


def test_the_changelog_top_entry_names_the_version():
    first = changelog_headings()[0]
    match = HEADING.match(first)
    assert match, first
    assert ".".join(match.group(1, 2, 3)) == trainer.__version__, first


def test_every_changelog_heading_is_a_version_with_a_date_newest_first():
    headings = changelog_headings()
    assert len(headings) > 1
    versions, dates = [], []
    for heading in headings:
        match = HEADING.match(heading)
        assert match, f"CHANGELOG.md: {heading!r} is not '## X.Y.Z (YYYY-MM-DD): title'"
        assert not re.search(r"\blater\b|\blatest\b|second round", heading), heading
        versions.append(tuple(int(n) for n in match.group(1, 2, 3)))
        dates.append(match.group(4))
    assert all(a > b for a, b in zip(versions, versions[1:])), "versions must strictly decrease downward"
    assert dates == sorted(dates, reverse=True), "dates must not increase downward"
    assert versions[-1] == (0, 1, 0)


def test_the_release_note_has_a_breaking_part():
    text = CHANGELOG.read_text(encoding="utf-8")
    top = text.split("\n## ")[1]
    assert "\n### Breaking / Upgrading\n" in top


# ---- the version in an export's record --------------------------------------------------------------------------


def medusa_checkpoint(tmp_path: Path) -> tuple[str, dict[str, str]]:
    """A Medusa-1 training checkpoint of heads trained against a tiny target, with the target's fingerprint."""
    target = tmp_path / "target"
    tiny_llama(0, 64, dtype=torch.float32).save_pretrained(target)
    config = AutoConfig.from_pretrained(target)
    heads = MedusaDrafter(MedusaConfig(hidden_size=config.hidden_size, vocab_size=config.vocab_size, num_heads=2))
    print_ = fingerprint(str(target), config)
    checkpoint = {
        "state_dict": {f"drafter.{k}": v for k, v in heads.state_dict().items()},
        "drafter": medusa_kind.make_record(heads.config, str(target), config).to_dict(),
        "frozen_models": {"target": print_},
    }
    path = tmp_path / "medusa.ckpt"
    torch.save(checkpoint, path)
    return str(path), print_


@pytest.mark.usefixtures("one_thread")
def test_an_export_records_the_version(tmp_path):
    ckpt, print_ = medusa_checkpoint(tmp_path)
    folder, _ = export(ckpt, str(tmp_path / "medusa_vllm"))
    assert export_version(folder) == trainer.__version__
    assert json.loads((Path(folder) / EXPORT_RECORD).read_text())[EXPORT_VERSION_KEY] == trainer.__version__
    assert export_record(folder) == print_  # the target's fingerprint, read as before


def test_an_export_from_before_the_version_is_read_as_before(tmp_path):
    print_ = {"path": "t", "config": "c", "weights": "w", "sample": "s"}
    (tmp_path / EXPORT_RECORD).write_text(json.dumps({"target": print_}))  # what exports wrote before 0.21.0
    assert export_record(tmp_path) == print_
    assert export_version(tmp_path) is None
    assert export_version(tmp_path / "nothing_here") is None
    write_export_record(tmp_path, print_)
    assert export_record(tmp_path) == print_ and export_version(tmp_path) == trainer.__version__
