"""The DFlash quickstart's data, made as recipes/quickstart/dflash.yaml's header says: ``draftsmith prepare``, then its
``draftsmith generate`` line as printed, run on the tiny target with the artifacts' folders moved to a temporary one
(a small corpus: a few prompts, so that 192 new tokens each take seconds)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from trainer.cli import main as draftsmith

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _header_line(recipe: Path, start: str) -> list[str]:
    lines = [line.lstrip("#").strip() for line in recipe.read_text(encoding="utf-8").splitlines() if line[:1] == "#"]
    (line,) = [line for line in lines if line.startswith(start)]
    return shlex.split(line)[1:]


def test_the_dflash_headers_prepare_and_generate_lines_make_its_training_file(tiny_target, tmp_path):
    recipe = REPO / "recipes" / "quickstart" / "dflash.yaml"
    artifacts = tmp_path / "artifacts"

    def moved(argv: list[str]) -> list[str]:
        return [a.replace("artifacts/tiny_target", str(tiny_target)).replace("artifacts", str(artifacts)) for a in argv]

    prepare = moved(_header_line(recipe, "draftsmith prepare "))
    assert draftsmith([*prepare, "--vocab_size", "300", "--max_files", "4", "--prompts_per_file", "1"]) == 0
    generate = moved(_header_line(recipe, "draftsmith generate "))
    assert draftsmith(generate) == 0

    source = Path(generate[generate.index("--input_file") + 1])
    output = Path(generate[generate.index("--output_file") + 1])
    assert source == artifacts / "corpus" / "train_prompts.jsonl"
    assert output == artifacts / "dflash" / "train_completions.jsonl"  # the recipe's train_files, moved
    prompts = [json.loads(line)["prompt"] for line in source.read_text().splitlines()]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert prompts and [r["prompt"] for r in records] == prompts
    assert all(r["text"].startswith(r["prompt"]) and len(r["text"]) > len(r["prompt"]) for r in records)
