"""Command-line flags spelled one way in every ``draftsmith`` subcommand: words joined by underscores.

``fit`` and ``validate`` (LightningCLI: ``--trainer.max_steps``, ``--ckpt_path``), ``generate`` and ``precompute``
(jsonargparse, whose flags are the parameter names) spell their flags with underscores; every argparse tool
(``eval``, ``export``, ``plan``, ``slurm``, ``compare``, ``prepare``, ``demo``) builds its parser with
:class:`ToolParser`, which spells them the same way and refuses a flag written with dashes in one line that names
the flag it means (``draftsmith eval: --max-new-tokens is spelled --max_new_tokens``), exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


class ToolParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` that names the right flag when given one spelled with dashes (its own flags are
    underscore words: tests/unit/test_flags.py checks every tool's). Its subcommand parsers (``add_subparsers``) are
    ToolParsers too."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        """Refuse a dashed spelling of a known flag (exit status 2, one line), then parse as argparse does."""
        tokens = list(sys.argv[1:] if args is None else args)
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
