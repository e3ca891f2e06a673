"""Drafter kind ``peagle``: P-EAGLE, the EAGLE-3 drafter drafting K tokens in one forward (module.py).

P-EAGLE extends EAGLE-3 (trainer/methods/eagle3/: its module, vocabulary map, records and exporters). Exported in the
speculators format ``peagle-speculators`` (export.py); drafted as a chain or a tree of the depths' top-k paths by
proposer.py, on the drafter's own trained embedding.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

from trainer.decoding.head_tree import tree_or_default
from trainer.decoding.options import ProposerOptions
from trainer.export import serving, speculators
from trainer.methods.eagle3 import records
from trainer.methods.peagle.export import MODEL_TYPE, load_peagle, save_peagle
from trainer.methods.peagle.module import PEagleConfig, PEagleDrafter
from trainer.methods.peagle.proposer import PEagleProposer
from trainer.training.registry import DrafterKind, DrafterRecord, ExportFormat, register_kind

KIND = "peagle"


def make_record(config: PEagleConfig, target: str, target_architectures: list[str], depths: int) -> DrafterRecord:
    """The record of a drafter trained against ``target`` for ``depths`` drafts per forward."""
    return records.training_record(KIND, config, target, target_architectures, depths)


def build(record: DrafterRecord) -> PEagleDrafter:
    """An initialised drafter of the record's shape."""
    return PEagleDrafter(PEagleConfig(**record.config))


def load(folder: Path) -> tuple[PEagleDrafter, DrafterRecord]:
    drafter = load_peagle(str(folder))
    return drafter, records.export_record(KIND, drafter.config, *records.speculators_verifier(folder))


def write(drafter: PEagleDrafter, record: DrafterRecord, out_dir: Path) -> Path:
    if not record.target or record.draft_tokens is None:
        raise ValueError("the speculators format names the verifier and the drafts per forward: the record lacks them")
    return save_peagle(drafter, str(out_dir), record.target, record.draft_tokens, record.target_architectures)


DEFAULT_DEPTHS = 4
"""The drafts per forward of a folder that does not say (the objective's default ``num_depths``)."""


def proposer(drafter: PEagleDrafter, record: DrafterRecord, target: PreTrainedModel, options: ProposerOptions):
    """K drafts in one forward: the depths' argmax chain, or a tree of their top-k paths (``options.tree_choices``;
    the Medusa paper's tree for 4 depths by default)."""
    depths = record.draft_tokens or DEFAULT_DEPTHS
    choices = tree_or_default(options.tree_choices, depths, "depths") if options.tree else None
    return PEagleProposer(drafter, depths, choices)


SPECULATORS = ExportFormat(
    name="peagle-speculators",
    description="P-EAGLE in the speculators format (PEagleSpeculator): the speculators library",
    write=write,
    load=load,
    recognise=lambda folder: speculators.is_model_type(folder, MODEL_TYPE),
    serve=lambda folder, record: [serving.vllm_speculators(folder, "vLLM 0.27 to 0.33 (0.34 refuses P-EAGLE)")],
)

register_kind(
    DrafterKind(name=KIND, build=build, formats=(SPECULATORS,), proposer=proposer, load_weights=records.load_weights)
)
