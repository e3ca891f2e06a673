"""Drafter kind ``domino``: a DFlash drafter with Domino's causal correction head (module.py), DFlash's block refiner
of SpecForge (``DominoDraftModel``, arXiv 2605.29707).

Exported in SpecForge's Domino checkpoint layout (``domino``, export.py), the one format that holds the head; drafted
one block per round as a chain resolved left to right through the head (proposer.py; ``--tree`` is refused).
"""

from __future__ import annotations

from pathlib import Path

from trainer.export import serving
from trainer.export.files import folder_config
from trainer.methods.dflash import kind as dflash_kind
from trainer.methods.domino import export as formats
from trainer.methods.domino.module import DominoConfig, DominoDrafter
from trainer.methods.domino.proposer import DominoProposer, DominoTreeProposer
from trainer.training.registry import DrafterKind, DrafterRecord, ExportFormat, register_kind

KIND = "domino"


def make_record(config: DominoConfig, target: str | None, target_architectures: list[str]) -> DrafterRecord:
    """The record of a drafter trained against ``target`` (or read back from an export, ``target`` None)."""
    return dflash_kind.make_record(config, target, target_architectures, KIND)


def is_domino(config: dict) -> bool:
    """A SpecForge Domino config (``architectures: ["DominoDraftModel"]``)."""
    return config.get("architectures") == formats.ARCHITECTURES


def build(record: DrafterRecord) -> DominoDrafter:
    """An initialised drafter of the record's shape."""
    return DominoDrafter(DominoConfig(**record.config))


def load_domino(folder: Path) -> tuple[DominoDrafter, DrafterRecord]:
    drafter = formats.load_domino(str(folder))
    return drafter, make_record(drafter.config, None, [])


def write_domino(drafter: DominoDrafter, record: DrafterRecord, out_dir: Path) -> Path:
    return formats.save_domino(drafter, str(out_dir))


DOMINO = ExportFormat(
    name="domino",
    description="DFlash with Domino's GRU correction head, SpecForge's Domino layout (DominoDraftModel): SGLang",
    write=write_domino,
    load=load_domino,
    recognise=lambda folder: is_domino(folder_config(folder)),
    serve=lambda folder, record: [serving.NO_ENGINE],
)

proposer = dflash_kind.proposer_factory(DominoProposer, DominoTreeProposer)

register_kind(DrafterKind(name=KIND, build=build, formats=(DOMINO,), proposer=proposer))
