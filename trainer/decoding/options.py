"""How to draft with a drafter, said once: :class:`ProposerOptions`.

The same options reach a proposer from every side: ``draftsmith eval`` makes one flag per field (its type, default and
help read here: :func:`add_option_arguments`, :func:`options_from_arguments`), the training callback takes them as
its ``options`` argument (a recipe writes ``init_args: {options: {tree: true, tree_nodes: 16}}``), and ``draftsmith
compare`` reads them from a method's ``options`` and hands them to both, as the callback's argument and as eval's
flags (:func:`option_arguments`). A drafter kind's proposer factory reads what applies to it and refuses what does not.
"""

from __future__ import annotations

import argparse
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from trainer.interface.errors import UsageError

TreePaths = tuple[tuple[int, ...], ...]


def read_tree(path: str | Path) -> TreePaths:
    """Tree paths from a JSON file: a list of paths, or the ``paths`` of a file ``--write_tree`` wrote."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--tree_choices {path}: not a readable JSON file ({err})") from err
    paths = data.get("paths") if isinstance(data, dict) else data
    if not isinstance(paths, list) or not all(isinstance(p, list) for p in paths):
        raise ValueError(f"--tree_choices {path}: expected a list of paths (lists of top-k ranks)")
    return tuple(tuple(int(r) for r in p) for p in paths)


def write_tree(path: str | Path, paths: TreePaths, **measured: object) -> Path:
    """A tree file :func:`read_tree` reads: ``{"paths": ..., "nodes": N}`` and what it was built from (``measured``,
    e.g. the heads' ``accuracy``)."""
    record = {"paths": [list(p) for p in paths], "nodes": len(paths), **measured}
    Path(path).write_text(json.dumps(record) + "\n")
    return Path(path)


@dataclass(frozen=True)
class ProposerOptions:
    """How to draft with a drafter in ``draftsmith eval``, the training callback and ``draftsmith compare`` (each kind
    reads what applies to it and refuses what does not).

    Attributes:
        tree: draft a tree instead of a chain (eagle3, peagle, dflash, medusa, mtp_heads, mtp; greedy verification, a
            sampled chain at a temperature).
        tree_nodes: the tree's node budget (draft tokens verified in one target forward).
        tree_top_k: children per expanded tree node, and nodes expanded per depth.
        rank_temperature: temperature of the log-probabilities that rank tree nodes.
        tree_choices: parallel heads and P-EAGLE: the tree's paths of per-head (per-depth) top-k ranks (None: the
            kind's default); on the command line a JSON file of them (``draftsmith eval --write_tree FILE`` writes
            one).
        exit_layer: self-speculative drafters (early-exit, LayerSkip): the layer the draft exits at; on the command
            line also a sweep such as 1,2,3 (one report each, in OUT/exit_<E>).
        accept_threshold: dynamic draft length: stop a chain, or prune a tree, where the drafter's predicted
            chance that the path is accepted (the product of its drafts' probabilities) falls under this value, in
            [0, 1]; 0 is off (eagle3, peagle, dflash, medusa, mtp_heads, mtp, draft models); on the command line also a
            sweep such as 0,0.1,0.3 (side by side in one report).
    """

    tree: bool = False
    tree_nodes: int = 24
    tree_top_k: int = 4
    rank_temperature: float = 0.1
    tree_choices: TreePaths | None = field(default=None, metadata={"file": (read_tree, write_tree)})
    exit_layer: int | None = field(default=None, metadata={"sweep": True})
    accept_threshold: float = field(default=0.0, metadata={"side_by_side": True})

    def __post_init__(self) -> None:
        if self.tree_nodes < 1 or self.tree_top_k < 1 or not self.rank_temperature > 0:
            raise ValueError(
                "proposer options: need tree_nodes >= 1, tree_top_k >= 1 and rank_temperature > 0; got "
                f"{self.tree_nodes}, {self.tree_top_k}, {self.rank_temperature}"
            )
        if self.exit_layer is not None and self.exit_layer < 1:
            raise ValueError(f"proposer options: exit_layer must be >= 1, got {self.exit_layer}")
        if not 0.0 <= self.accept_threshold <= 1.0:  # also refuses NaN
            raise UsageError(
                f"proposer options: accept_threshold must be in [0, 1], got {self.accept_threshold}",
                hint="0 turns dynamic draft length off; 0.1 to 0.5 are usual values",
            )
        if self.tree_choices is not None:  # lists from a recipe: tuples, so that the options stay hashable
            object.__setattr__(self, "tree_choices", tuple(tuple(int(r) for r in p) for p in self.tree_choices))


def field_help() -> dict[str, str]:
    """Each field's description, from the ``Attributes`` section of :class:`ProposerOptions`' docstring (as plain
    text: a command's help)."""
    text = (ProposerOptions.__doc__ or "").split("Attributes:", 1)[-1]
    found: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        match = re.match(r"\s{8}(\w+): (.*)", line)
        if match:
            name, found[match.group(1)] = match.group(1), match.group(2).strip()
        elif name and line.strip():
            found[name] += " " + line.strip()
    return {key: text.replace("``", "").rstrip(".") for key, text in found.items()}


def _plain_type(hint: object) -> type:
    """``int`` of ``int | None``; the hint itself otherwise."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return inner
    return hint  # type: ignore[return-value]


def positive_ints(flag: str) -> Callable[[str], list[int]]:
    """An argparse type: integers >= 1 separated by commas, errors naming ``flag``."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{flag} must be integers separated by commas, got {text!r}") from err
        if not values or any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(f"{flag} needs values >= 1, got {text!r}")
        return values

    return parse


def floats(flag: str) -> Callable[[str], list[float]]:
    """An argparse type: numbers separated by commas, errors naming ``flag`` (the range is the options' check)."""

    def parse(text: str) -> list[float]:
        try:
            values = [float(x) for x in text.split(",") if x.strip()]
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{flag} must be numbers separated by commas, got {text!r}") from err
        if not values:
            raise argparse.ArgumentTypeError(f"{flag} needs at least one value, got {text!r}")
        return values

    return parse


def add_option_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field of :class:`ProposerOptions` (``--tree``, ``--tree_nodes``...): its type, its default and
    its help from the class. A boolean is a switch; a field read from a file takes the file; a swept field (one report
    each) or a field measured side by side (one report) takes several values separated by commas."""
    hints = typing.get_type_hints(ProposerOptions)
    described = field_help()
    group = parser.add_argument_group("drafting options (ProposerOptions)")
    for f in fields(ProposerOptions):
        flag, kind = f"--{f.name}", _plain_type(hints[f.name])
        help_ = described.get(f.name, "")
        if kind is bool:
            group.add_argument(flag, action="store_true", help=help_)
        elif "file" in f.metadata:
            group.add_argument(flag, metavar="FILE", default=None, help=help_)
        elif f.metadata.get("sweep"):
            group.add_argument(flag, type=positive_ints(flag), default=None, metavar="N[,N...]", help=help_)
        elif f.metadata.get("side_by_side"):
            group.add_argument(flag, type=floats(flag), default=f.default, metavar="X[,X...]", help=help_)
        else:
            default = f.default if f.default is not MISSING else None
            group.add_argument(flag, type=kind, default=default, help=f"{help_} (default {default})")


def options_from_arguments(args: argparse.Namespace) -> list[ProposerOptions]:
    """The options of parsed arguments (:func:`add_option_arguments`): one per combination of the values of the
    swept and side-by-side fields, in order (the swept field outermost); a file that cannot be read, or a value out
    of range, raises ValueError."""
    values: dict[str, object] = {}
    several: list[tuple[str, list]] = []
    for f in fields(ProposerOptions):
        value = getattr(args, f.name)
        if "file" in f.metadata and value is not None:
            value = f.metadata["file"][0](value)
        if f.metadata.get("sweep") or f.metadata.get("side_by_side"):
            several.append((f.name, value if isinstance(value, list) else [value]))
            continue
        values[f.name] = value
    combos: list[dict[str, object]] = [{}]
    for name, swept in several:
        combos = [{**c, name: v} for c in combos for v in swept]
    return [ProposerOptions(**values, **c) for c in combos]


def option_arguments(options: ProposerOptions, folder: Path) -> list[str]:
    """The ``draftsmith eval`` flags that give ``options`` (fields at their default left out); a field the command
    line reads from a file is written to ``folder/<field>.json``."""
    argv: list[str] = []
    for f in fields(ProposerOptions):
        value = getattr(options, f.name)
        if value == f.default:
            continue
        flag = f"--{f.name}"
        if isinstance(value, bool):
            argv.append(flag)
        elif "file" in f.metadata:
            folder.mkdir(parents=True, exist_ok=True)
            argv += [flag, str(f.metadata["file"][1](folder / f"{f.name}.json", value))]
        else:
            argv += [flag, str(value)]
    return argv
