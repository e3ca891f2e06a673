"""``draftsmith prepare``'s prompt files, and the DFlash-family quickstarts that read them.

prepare writes ``train_prompts.jsonl`` (the cut of ``draftsmith compare`` and the benchmarks) and
``heldout_prompts.jsonl`` (what ``draftsmith demo`` writes to artifacts/heldout_prompts.jsonl) beside the corpus and
keeps them on a rerun; the quickstart recipes' headers and the method pages make the DFlash completions with
``draftsmith prepare`` and ``draftsmith generate``, and those command lines parse.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from tests.unit.test_docs import Command, check_command, commands, names_only
from trainer.compare.config import Regenerate
from trainer.compare.run import training_prompts as compare_training_prompts
from trainer.data.corpus import HELDOUT_PROMPTS, PROMPT_CHARS, PROMPTS_PER_FILE, main, write_heldout_prompts
from trainer.demo import build_parser as demo_parser
from trainer.interface.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart"
DFLASH_RECIPES = ["dflash", "dspark", "dflash2", "domino", "xpress", "dflash_precompute", "dflash_offline"]
DFLASH_PAGES = ["dflash", "dflash2", "dspark", "domino", "xpress"]
SMALL = ["--vocab_size", "300", "--max_files", "12"]


def _prompts(path: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines()]


def _texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "corpus"
    assert main(["--output_dir", str(out), *SMALL]) == 0
    return out


def test_the_defaults_are_compares_the_benchmarks_and_the_demos():
    bench = (REPO / "bench" / "common.py").read_text(encoding="utf-8")  # read as source: tests import no bench/
    assert f"\nPROMPT_CHARS = {PROMPT_CHARS}\n" in bench
    for name in ("training_prompts", "heldout_prompts", "write_heldout_prompts"):  # the benchmarks' cut is prepare's
        assert re.search(rf"from trainer\.data\.corpus import {name}\b", bench), name
    assert PROMPT_CHARS == Regenerate.prompt_chars
    assert PROMPTS_PER_FILE == Regenerate.prompts_per_document
    assert demo_parser().parse_args([]).max_prompts == HELDOUT_PROMPTS


def test_prepare_writes_the_training_prompts_as_compare_and_the_benchmarks_cut_them(prepared, tmp_path):
    """bench.common.training_prompts (bench_dflash's prepare step) is compare's cut at 160 characters, seed 0."""
    written = _prompts(prepared / "train_prompts.jsonl")
    compare_training_prompts(prepared / "train.jsonl", tmp_path / "compare.jsonl", PROMPT_CHARS, PROMPTS_PER_FILE, 0)
    assert written == _prompts(tmp_path / "compare.jsonl")
    # what the cut is, read off the documents: every file's start, the rest cut at line starts, 160 characters each
    documents = _texts(prepared / "train.jsonl")
    assert {d[:PROMPT_CHARS] for d in documents if d[:PROMPT_CHARS].strip()} <= set(written)
    assert len(documents) < len(written) <= PROMPTS_PER_FILE * len(documents)
    for prompt in written:
        assert len(prompt) <= PROMPT_CHARS
        assert any(d.startswith(prompt) or f"\n{prompt}" in d for d in documents), prompt


def test_prepare_writes_the_demos_heldout_prompts(prepared, tmp_path):
    """The demo's artifacts/heldout_prompts.jsonl: the first 160 characters of the first 10 held-out files."""
    written = _prompts(prepared / "heldout_prompts.jsonl")
    assert written == [text[:PROMPT_CHARS] for text in _texts(prepared / "heldout.jsonl")[:HELDOUT_PROMPTS]]
    write_heldout_prompts(prepared / "heldout.jsonl", tmp_path / "demo.jsonl")  # as the demo calls it
    assert (prepared / "heldout_prompts.jsonl").read_bytes() == (tmp_path / "demo.jsonl").read_bytes()


def test_a_rerun_keeps_the_prompts_and_other_arguments_cut_them_again(tmp_path, capsys):
    out = tmp_path / "corpus"
    assert main(["--output_dir", str(out), *SMALL]) == 0
    files = [out / "train_prompts.jsonl", out / "heldout_prompts.jsonl"]
    stamps = [f.stat().st_mtime_ns for f in files]
    capsys.readouterr()
    assert main(["--output_dir", str(out), *SMALL]) == 0
    said = capsys.readouterr().out
    assert said.startswith("reused corpus") and "(reused)" in said
    assert [f.stat().st_mtime_ns for f in files] == stamps

    before = _prompts(files[0])
    assert main(["--output_dir", str(out), *SMALL, "--prompts_per_file", "1", "--heldout_prompts", "1"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("reused corpus") and "(reused)" not in said
    documents = _texts(out / "train.jsonl")
    assert len(_prompts(files[0])) == len(documents) < len(before)
    assert len(_prompts(files[1])) == 1

    assert main(["--output_dir", str(out), *SMALL, "--overwrite"]) == 0  # back to the defaults, every file rebuilt
    assert _prompts(files[0]) == before and "(reused)" not in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--prompt_chars", "--prompts_per_file", "--heldout_prompts"])
def test_a_bad_count_is_refused_in_one_line(flag, tmp_path):
    with pytest.raises(UsageError, match=rf"^{flag[2:]} must be at least 1, got 0$"):
        main(["--output_dir", str(tmp_path / "corpus"), *SMALL, flag, "0"])
    assert not (tmp_path / "corpus").exists()  # refused before the corpus is built


# ---- the quickstarts ---------------------------------------------------------------------------------------------


def _header_commands(recipe: Path) -> list[Command]:
    """The ``draftsmith`` command lines of a recipe's header comment (``#   draftsmith ...``)."""
    found = []
    for number, line in enumerate(recipe.read_text(encoding="utf-8").splitlines(), 1):
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if re.match(r"draftsmith\s", text):
            found.append(Command(str(recipe.relative_to(REPO)), number, text))
    return found


def _train_files(recipe: Path) -> list[str] | None:
    """The recipe's ``data.init_args.train_files`` (None for a recipe that trains from shards)."""
    files = yaml.safe_load(recipe.read_text(encoding="utf-8"))["data"]["init_args"].get("train_files")
    return None if files is None else list(files)


def _generate_paths(found: list[Command]) -> tuple[str, str]:
    """(--input, --output) of the one ``draftsmith generate`` line; the ``draftsmith prepare`` line writes its input."""
    generate = [shlex.split(c.text) for c in found if c.text.startswith("draftsmith generate ")]
    prepare = [shlex.split(c.text) for c in found if c.text.startswith("draftsmith prepare ")]
    assert len(generate) == 1 and len(prepare) == 1, [c.text for c in found]
    (argv,), (prep,) = generate, prepare
    corpus = prep[prep.index("--output_dir") + 1]
    source, output = argv[argv.index("--input_file") + 1], argv[argv.index("--output_file") + 1]
    assert source == f"{corpus}/train_prompts.jsonl", (source, corpus)
    assert argv[argv.index("--prompt_field") + 1] == "prompt" and argv[argv.index("--max_new_tokens") + 1] == "192"
    return source, output


@pytest.mark.parametrize("name", DFLASH_RECIPES)
def test_the_dflash_quickstarts_make_their_data_with_draftsmith(name, monkeypatch):
    monkeypatch.chdir(REPO)
    recipe = QUICKSTART / f"{name}.yaml"
    text = recipe.read_text(encoding="utf-8")
    assert "bench.bench_dflash" not in text and "--prepare-only" not in text
    for command in _header_commands(recipe):
        assert check_command(command) is None, command.id
    # every one reads the completions dflash.yaml's header makes (dflash_offline.yaml: through precompute's shards)
    _, output = _generate_paths(_header_commands(QUICKSTART / "dflash.yaml"))
    assert _train_files(recipe) == ([output] if name != "dflash_offline" else None)


@pytest.mark.parametrize("name", DFLASH_PAGES)
def test_the_dflash_method_pages_make_the_data_their_recipe_trains_on(name, monkeypatch):
    monkeypatch.chdir(REPO)
    page = REPO / "docs" / "methods" / f"{name}.md"
    assert "bench.bench_dflash" not in page.read_text(encoding="utf-8")
    found = [c for c in commands(page) if not names_only(c)]  # an inline `draftsmith eval` only names a command
    for command in found:
        assert check_command(command) is None, command.id
    _, output = _generate_paths(found)
    fits = [shlex.split(c.text) for c in found if c.text.startswith("draftsmith fit ")]
    recipes = [argv[argv.index("--config") + 1] for argv in fits]
    assert f"recipes/quickstart/{name}.yaml" in recipes
    for recipe in recipes:  # the offline recipe trains from shards of the same completions (no train_files)
        assert _train_files(REPO / recipe) in ([output], None), recipe
    assert _train_files(QUICKSTART / f"{name}.yaml") == [output]
