"""Drafter kind ``peagle``: P-EAGLE, the EAGLE-3 drafter drafting K tokens in one forward (peagle_module.py).

Registered from kind.py (the registry imports one ``kind`` module per method folder, and P-EAGLE shares the EAGLE-3
module, vocabulary map and exporters). Exported in the speculators format ``peagle-speculators``
(peagle_export.py); drafted as a chain by peagle_proposer.py, on the drafter's own trained embedding.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

from trainer.checkpoints.reading import sub_state_dict
from trainer.decoding.options import ProposerOptions
from trainer.errors import CheckpointError, UsageError
from trainer.export.files import folder_config
from trainer.methods.eagle3.module import flag_weight_mismatch
from trainer.methods.eagle3.peagle_export import load_peagle, save_peagle
from trainer.methods.eagle3.peagle_module import PEagleConfig, PEagleDrafter
from trainer.methods.eagle3.peagle_proposer import PEagleProposer
from trainer.registry import DrafterKind, DrafterRecord, ExportFormat, load_components, register_kind

KIND = "peagle"


def make_record(config: PEagleConfig, target: str, target_architectures: list[str], depths: int) -> DrafterRecord:
    """The record of a drafter trained against ``target`` for ``depths`` drafts per forward."""
    return DrafterRecord(
        kind=KIND,
        config=config.to_dict(),
        components={"drafter": "drafter."},
        target=target,
        target_architectures=list(target_architectures or []),
        target_layers=list(config.aux_layers),
        target_vocab_size=config.vocab_size,
        target_hidden_size=config.target_hidden_size,
        tokenizer=target,
        draft_tokens=depths,
    )


def build(record: DrafterRecord) -> PEagleDrafter:
    """An initialised drafter of the record's shape."""
    return PEagleDrafter(PEagleConfig(**record.config))


def load_weights(drafter: PEagleDrafter, record: DrafterRecord, state: dict, where: str) -> None:
    """A training checkpoint's weights, refused naming the norm flag when they disagree with the record's flags."""
    names = sub_state_dict(state, record.components.get("drafter", "drafter.")).keys()
    problem = flag_weight_mismatch(drafter.config, names)
    if problem:
        raise CheckpointError(f"{where}: the drafter's weights disagree with its recorded config: {problem}")
    load_components(drafter, record, state, where)


def load(folder: Path) -> tuple[PEagleDrafter, DrafterRecord]:
    drafter = load_peagle(str(folder))
    spec = folder_config(folder).get("speculators_config") or {}
    verifier = (spec.get("verifier") or {}).get("name_or_path")
    methods = spec.get("proposal_methods") or [{}]
    c = drafter.config
    record = DrafterRecord(
        kind=KIND, config=c.to_dict(), target=verifier or None, target_layers=list(c.aux_layers),
        target_vocab_size=c.vocab_size, target_hidden_size=c.target_hidden_size,
        draft_tokens=methods[0].get("speculative_tokens"),
    )  # fmt: skip
    return drafter, record


def write(drafter: PEagleDrafter, record: DrafterRecord, out_dir: Path) -> Path:
    if not record.target or record.draft_tokens is None:
        raise ValueError("the speculators format names the verifier and the drafts per forward: the record lacks them")
    return save_peagle(drafter, str(out_dir), record.target, record.draft_tokens, record.target_architectures)


def proposer(drafter: PEagleDrafter, record: DrafterRecord, target: PreTrainedModel, options: ProposerOptions):
    """Chain drafting, K drafts in one forward (no tree)."""
    if options.tree:
        raise UsageError("--tree: a P-EAGLE drafter drafts a chain in one forward; drop --tree")
    return PEagleProposer(drafter)


SPECULATORS = ExportFormat(
    name="peagle-speculators",
    description="P-EAGLE in the speculators format (PEagleSpeculator): the speculators library",
    write=write,
    load=load,
    recognise=lambda folder: folder_config(folder).get("speculators_model_type") == "peagle",
)

register_kind(DrafterKind(name=KIND, build=build, formats=(SPECULATORS,), proposer=proposer, load_weights=load_weights))
