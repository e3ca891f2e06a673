"""Drafter kind ``xpress``: a DFlash drafter with XPress's causal refiner head (module.py), DFlash's block refiner of
speculators 0.9 (``XPressDraftModel``).

Exported in speculators' XPress format (``xpress``: ``XPressSpeculator``, export.py), the one format that holds the
refiner; drafted one block per round as a chain (greedy: K Jacobi passes; sampled: left to right) or as a DDTree with
``--tree`` (proposer.py).
"""

from __future__ import annotations

from pathlib import Path

from trainer.export import serving
from trainer.export.files import folder_config
from trainer.export.speculators import read_block
from trainer.methods.dflash import kind as dflash_kind
from trainer.methods.xpress import export as formats
from trainer.methods.xpress.module import XPressConfig, XPressDrafter
from trainer.methods.xpress.proposer import XPressProposer, XPressTreeProposer
from trainer.training.registry import DrafterKind, DrafterRecord, ExportFormat, register_kind

KIND = "xpress"


def make_record(config: XPressConfig, target: str | None, target_architectures: list[str]) -> DrafterRecord:
    """The record of a drafter trained against ``target`` (or read back from an export, ``target`` None)."""
    return dflash_kind.make_record(config, target, target_architectures, KIND)


def is_xpress(config: dict) -> bool:
    """A speculators XPress config (``speculators_model_type: "xpress"``)."""
    return read_block(config).model_type == formats.MODEL_TYPE


def build(record: DrafterRecord) -> XPressDrafter:
    """An initialised drafter of the record's shape."""
    return XPressDrafter(XPressConfig(**record.config))


def load_xpress(folder: Path) -> tuple[XPressDrafter, DrafterRecord]:
    drafter = formats.load_xpress(str(folder))
    return drafter, make_record(drafter.config, dflash_kind.verifier_of(folder), [])


def write_xpress(drafter: XPressDrafter, record: DrafterRecord, out_dir: Path) -> Path:
    return formats.save_xpress(drafter, str(out_dir), dflash_kind.verifier(record), record.target_architectures)


XPRESS = ExportFormat(
    name="xpress",
    description="DFlash with XPress's causal refiner, speculators' XPress format (XPressSpeculator)",
    write=write_xpress,
    load=load_xpress,
    recognise=lambda folder: is_xpress(folder_config(folder)),
    serve=lambda folder, record: [serving.NO_ENGINE],
)

proposer = dflash_kind.proposer_factory(XPressProposer, XPressTreeProposer)

register_kind(DrafterKind(name=KIND, build=build, formats=(XPRESS,), proposer=proposer))
