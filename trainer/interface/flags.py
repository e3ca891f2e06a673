"""Command-line flags spelled one way in every ``draftsmith`` subcommand: one name per concept, words joined by
underscores.

``fit`` and ``validate`` (LightningCLI: ``--trainer.max_steps``, ``--ckpt_path``), ``generate`` and ``precompute``
(jsonargparse, whose flags are the parameter names) spell their flags with underscores; every argparse tool
(``eval``, ``export``, ``plan``, ``slurm``, ``compare``, ``prepare``, ``demo``) builds its parser with
:class:`ToolParser`, which spells them the same way and refuses a flag written with dashes in one line that names
the flag it means (``draftsmith eval: --max-new-tokens is spelled --max_new_tokens``), exit status 2.

One name per concept (tests/unit/test_flags.py reads every parser against :data:`VOCABULARY`): a folder a command
writes is ``--output_dir``, a file it writes ``--output_file`` (and reads ``--input_file``), a training checkpoint it
reads ``--ckpt_path`` (as ``fit --ckpt_path``), the target model ``--target`` (a folder or a hub id) and its weights'
dtype ``--target_dtype`` (as the recipes' ``target_dtype``), a number of prompts ``--max_prompts``. An on/off flag
takes ``true`` or ``false`` in every command, and alone means ``true`` (``--tree``, ``--tree true``, ``--progress``).
A spelling a release renamed is refused in one line naming the new one (:data:`RENAMED_FLAGS`), as renamed recipe
keys are.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import typing
from collections.abc import Callable, Sequence

RENAMED_FLAGS: dict[str, dict[str, str]] = {
    "draftsmith prepare": {"--out": "--output_dir"},
    "draftsmith eval": {"--out": "--output_dir", "--dtype": "--target_dtype"},
    "draftsmith compare": {"--out": "--output_dir"},
    "draftsmith export": {"--out": "--output_dir", "--ckpt": "--ckpt_path"},
    "draftsmith precompute": {"--out": "--output_dir"},  # --k: a recipe key too (trainer/interface/renamed_keys.py)
    "draftsmith generate": {
        "--input": "--input_file",
        "--output": "--output_file",
        "--dtype": "--target_dtype",
        "--model": "--served_model_name",
    },
    "draftsmith slurm submit": {"--log_dir": "--output_dir"},
    "draftsmith plan": {"--target_config": "--target"},
    "draftsmith demo": {"--prompts": "--max_prompts"},
}
"""Command -> {old flag: its name now}: refused in one line naming the new one (CHANGELOG.md, 0.14.0's Breaking)."""

TRUE, FALSE = ("true", "yes", "1"), ("false", "no", "0")


def switch_value(text: str) -> bool:
    """``true``/``false`` (also yes/no, 1/0, any case) as a bool; a ValueError naming the accepted words otherwise."""
    word = str(text).strip().lower()
    if word in TRUE or word in FALSE:
        return word in TRUE
    raise ValueError(f"takes true or false, got {text!r}")


class _Switch(argparse.Action):
    """An on/off flag: alone it means true; ``--flag true`` or ``--flag false`` set it (what ``store_true`` becomes
    in a :class:`ToolParser`, so that every command's booleans read alike)."""

    def __init__(self, option_strings, dest, default=False, required=False, help=None) -> None:  # noqa: A002
        super().__init__(
            option_strings, dest, nargs="?", const=True, default=default, required=required, help=help,
            metavar="true|false",
        )  # fmt: skip

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            value = True if values is True else switch_value(values)
        except ValueError as err:
            parser.error(f"{option_string} {err}")
        setattr(namespace, self.dest, value)


def refused_renamed(prog: str, tokens: Sequence[str]) -> str | None:
    """The one-line refusal of the first flag in ``tokens`` (up to ``--``) that ``prog`` renamed, or None."""
    renamed = RENAMED_FLAGS.get(prog, {})
    for token in tokens:
        if token == "--":
            break
        old = token.split("=", 1)[0]
        if old in renamed:
            return f"{prog}: {old} is now {renamed[old]}"
    return None


def with_bare_switches(tokens: Sequence[str], switches: Sequence[str]) -> list[str]:
    """``tokens`` with ``true`` after each of ``switches`` given alone (followed by another flag or nothing): how a
    jsonargparse command, whose booleans need a value, reads a bare on/off flag as the argparse tools do."""
    out = list(tokens)
    i = 0
    while i < len(out):
        if out[i] == "--":
            break
        if out[i] in switches and (i + 1 == len(out) or out[i + 1].startswith("--")):
            out.insert(i + 1, "true")
        i += 1
    return out


def switches_of(function: Callable) -> tuple[str, ...]:
    """The on/off flags of a jsonargparse command built from ``function``: its ``bool`` parameters."""
    hints = typing.get_type_hints(function)
    return tuple(f"--{name}" for name in inspect.signature(function).parameters if hints.get(name) is bool)


def command_line(prog: str, argv: Sequence[str] | None, function: Callable) -> tuple[list[str], str | None]:
    """A jsonargparse command's arguments (``argv``, else ``sys.argv[1:]``) with its bare switches (the ``bool``
    parameters of ``function``, the one its parser is built from) given ``true``, and the one-line refusal of a flag
    ``prog`` renamed among them (None: there is none)."""
    tokens = list(sys.argv[1:] if argv is None else argv)
    return with_bare_switches(tokens, switches_of(function)), refused_renamed(prog, tokens)


class ToolParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` that names the right flag when given one spelled with dashes (its own flags are
    underscore words: tests/unit/test_flags.py checks every tool's) or renamed by a release (:data:`RENAMED_FLAGS`),
    and whose ``store_true`` flags take ``true``/``false`` too. Its subcommand parsers (``add_subparsers``) are
    ToolParsers too."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", "store_true", _Switch)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        """Refuse a dashed spelling of a known flag, or a renamed one (exit status 2, one line), then parse as
        argparse does."""
        tokens = list(sys.argv[1:] if args is None else args)
        refusal = refused_renamed(self.prog, tokens)
        if refusal is not None:
            self.exit(2, refusal + "\n")
        for token in tokens:
            if token == "--":  # what follows belongs to another command (fit arguments)
                break
            renamed = respelled(token)
            if renamed is not None and renamed in self._option_string_actions:
                self.exit(2, f"{self.prog}: {token.split('=', 1)[0]} is spelled {renamed}\n")
        return super().parse_known_args(tokens, namespace)


def respelled(token: str) -> str | None:
    """The underscore spelling of a long flag written with dashes (``--max-new-tokens=8`` -> ``--max_new_tokens``),
    or None for anything else."""
    if not token.startswith("--"):
        return None
    name = token.split("=", 1)[0]
    if "-" not in name[2:]:
        return None
    return "--" + name[2:].replace("-", "_")


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of ``parser`` and of its subcommand parsers (for the tests that check their spelling)."""
    flags = []
    for action in parser._actions:
        flags += [f for f in action.option_strings if f.startswith("--")]
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                flags += option_strings(sub)
    return flags
