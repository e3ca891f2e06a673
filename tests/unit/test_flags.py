"""Flags are spelled one way in every subcommand (underscores, as fit, generate and precompute spell theirs), and a
flag spelled with dashes is refused in one line that names the right one."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from trainer.cli import TOOLS
from trainer.flags import ToolParser, option_strings, respelled

# the argparse tools, each with a build_parser(); generate and precompute are jsonargparse (their parameter names)
ARGPARSE_TOOLS = ("eval", "export", "plan", "slurm", "compare", "prepare", "demo")
JSONARGPARSE_TOOLS = ("generate", "precompute")


def parser_of(tool: str) -> ToolParser:
    module = importlib.import_module(TOOLS[tool][0].split(":")[0])
    return module.build_parser()


def test_every_tool_is_checked() -> None:
    assert set(TOOLS) == set(ARGPARSE_TOOLS) | set(JSONARGPARSE_TOOLS)


@pytest.mark.parametrize("tool", ARGPARSE_TOOLS)
def test_every_flag_of_every_tool_is_spelled_with_underscores(tool: str) -> None:
    parser = parser_of(tool)
    assert isinstance(parser, ToolParser)
    flags = option_strings(parser)
    assert "--help" in flags and len(flags) > 2
    assert [f for f in flags if "-" in f[2:]] == []


def test_precompute_flags_are_its_parameter_names() -> None:
    flags = [f for action in parser_of("precompute")._actions for f in action.option_strings if f.startswith("--")]
    assert flags and [f for f in flags if "-" in f[2:]] == []


@pytest.mark.parametrize(
    "tool, argv, old, new",
    [
        ("eval", ["--max-new-tokens", "8"], "--max-new-tokens", "--max_new_tokens"),
        ("eval", ["--target", "t", "--tree-nodes=16"], "--tree-nodes", "--tree_nodes"),
        ("plan", ["--gpu-memory", "80GB"], "--gpu-memory", "--gpu_memory"),
        ("slurm", ["submit", "--config", "r.yaml", "--dry-run"], "--dry-run", "--dry_run"),
        ("prepare", ["--out", "x", "--vocab-size", "300"], "--vocab-size", "--vocab_size"),
        ("demo", ["--kd-steps", "3"], "--kd-steps", "--kd_steps"),
    ],
)
def test_a_dashed_flag_is_refused_naming_the_new_spelling(tool, argv, old, new, capsys) -> None:
    module = importlib.import_module(TOOLS[tool][0].split(":")[0])
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert exit_.value.code == 2
    prog = "draftsmith slurm submit" if tool == "slurm" else f"draftsmith {tool}"
    assert capsys.readouterr().err == f"{prog}: {old} is spelled {new}\n"


def test_fit_arguments_after_the_separator_are_not_checked(capsys) -> None:
    parser = ToolParser(prog="draftsmith x")
    parser.add_argument("--dry_run", action="store_true")
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args(["--dry_run", "--", "--dry-run"])
    assert args.dry_run and args.rest == ["--dry-run"]
    with pytest.raises(SystemExit):  # an unknown dashed flag is argparse's own error
        parser.parse_args(["--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_respelled() -> None:
    assert respelled("--max-new-tokens=8") == "--max_new_tokens"
    assert respelled("--max_new_tokens") is None and respelled("-k") is None and respelled("a-b") is None


def test_the_command_refuses_a_dashed_flag_in_one_line_without_a_traceback() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "eval", "--target", "t", "--max-new-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "draftsmith eval: --max-new-tokens is spelled --max_new_tokens"
    assert "Traceback" not in result.stderr
