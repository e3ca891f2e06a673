"""Drafter kind ``dspark``: a DFlash drafter with DSpark's Markov and confidence heads (module.py), DFlash's block
refiner of speculators 0.9 (``DSparkDraftModel``).

Exported in speculators' DSpark format (``dspark``: ``DSparkSpeculator``, export.py), the one format that holds the
heads; drafted one block per round as a chain, or as a DDTree with ``--tree``, resolved left to right through the
heads (proposer.py). A training checkpoint written when DSpark was an option of DFlash (a ``dflash`` record whose
config sets the heads) is read as this kind (trainer/interface/renamed_keys.py ``MOVED_KINDS``).
"""

from __future__ import annotations

from pathlib import Path

from trainer.export import serving
from trainer.export.files import folder_config
from trainer.export.speculators import read_block
from trainer.methods.dflash import kind as dflash_kind
from trainer.methods.dspark import export as formats
from trainer.methods.dspark.module import DSparkConfig, DSparkDrafter
from trainer.methods.dspark.proposer import DSparkProposer, DSparkTreeProposer
from trainer.training.registry import DrafterKind, DrafterRecord, ExportFormat, register_kind

KIND = "dspark"


def make_record(config: DSparkConfig, target: str | None, target_architectures: list[str]) -> DrafterRecord:
    """The record of a drafter trained against ``target`` (or read back from an export, ``target`` None)."""
    return dflash_kind.make_record(config, target, target_architectures, KIND)


def is_dspark(config: dict) -> bool:
    """A speculators DSpark config (``speculators_model_type: "dspark"``)."""
    return read_block(config).model_type == formats.MODEL_TYPE


def build(record: DrafterRecord) -> DSparkDrafter:
    """An initialised drafter of the record's shape."""
    return DSparkDrafter(DSparkConfig(**record.config))


def load_dspark(folder: Path) -> tuple[DSparkDrafter, DrafterRecord]:
    drafter = formats.load_dspark(str(folder))
    return drafter, make_record(drafter.config, dflash_kind.verifier_of(folder), [])


def write_dspark(drafter: DSparkDrafter, record: DrafterRecord, out_dir: Path) -> Path:
    return formats.save_dspark(drafter, str(out_dir), dflash_kind.verifier(record), record.target_architectures)


DSPARK = ExportFormat(
    name="dspark",
    description="DFlash with DSpark's Markov and confidence heads, speculators' DSpark format (DSparkSpeculator)",
    write=write_dspark,
    load=load_dspark,
    recognise=lambda folder: is_dspark(folder_config(folder)),
    serve=lambda folder, record: [serving.NO_ENGINE],
)

proposer = dflash_kind.proposer_factory(DSparkProposer, DSparkTreeProposer)

register_kind(DrafterKind(name=KIND, build=build, formats=(DSPARK,), proposer=proposer))
