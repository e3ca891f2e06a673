"""Drafter kind ``dflash2``: a DFlash drafter with DFlash2's convolutions and path selector (module.py), DFlash's
block refiner of speculators 0.9 (``DFlash2DraftModel``).

Exported in speculators' DFlash2 format (``dflash2``: ``DFlash2DraftModel``, export.py), the one format that holds
the convolutions and the selector; drafted one block per round as a chain, or as a DDTree with ``--tree``, resolved
left to right through the selector (proposer.py).
"""

from __future__ import annotations

from pathlib import Path

from trainer.export import serving
from trainer.export.files import folder_config
from trainer.export.speculators import read_block
from trainer.methods.dflash import kind as dflash_kind
from trainer.methods.dflash2 import export as formats
from trainer.methods.dflash2.module import DFlash2Config, DFlash2Drafter
from trainer.methods.dflash2.proposer import DFlash2Proposer, DFlash2TreeProposer
from trainer.training.registry import DrafterKind, DrafterRecord, ExportFormat, register_kind

KIND = "dflash2"


def make_record(config: DFlash2Config, target: str | None, target_architectures: list[str]) -> DrafterRecord:
    """The record of a drafter trained against ``target`` (or read back from an export, ``target`` None)."""
    return dflash_kind.make_record(config, target, target_architectures, KIND)


def is_dflash2(config: dict) -> bool:
    """A speculators DFlash2 config (``speculators_model_type: "dflash2"``)."""
    return read_block(config).model_type == formats.MODEL_TYPE


def build(record: DrafterRecord) -> DFlash2Drafter:
    """An initialised drafter of the record's shape."""
    return DFlash2Drafter(DFlash2Config(**record.config))


def load_dflash2(folder: Path) -> tuple[DFlash2Drafter, DrafterRecord]:
    drafter = formats.load_dflash2(str(folder))
    return drafter, make_record(drafter.config, dflash_kind.verifier_of(folder), [])


def write_dflash2(drafter: DFlash2Drafter, record: DrafterRecord, out_dir: Path) -> Path:
    return formats.save_dflash2(drafter, str(out_dir), dflash_kind.verifier(record), record.target_architectures)


DFLASH2 = ExportFormat(
    name="dflash2",
    description="DFlash with DFlash2's convolutions and path selector, speculators' DFlash2 format (DFlash2DraftModel)",
    write=write_dflash2,
    load=load_dflash2,
    recognise=lambda folder: is_dflash2(folder_config(folder)),
    serve=lambda folder, record: [serving.NO_ENGINE],
)

proposer = dflash_kind.proposer_factory(DFlash2Proposer, DFlash2TreeProposer)

register_kind(DrafterKind(name=KIND, build=build, formats=(DFLASH2,), proposer=proposer))
