"""What the kind ``eagle3`` (kind.py) and the kinds extending it (``peagle``: trainer/methods/peagle/kind.py) record
and read alike: the drafter record of a training run or of an export, a checkpoint's weights checked against the norm
flags, and the verifier and drafts per round of a speculators-format folder."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from trainer.checkpoints.reading import sub_state_dict
from trainer.export.speculators import folder_block
from trainer.interface.errors import CheckpointError
from trainer.methods.eagle3.module import Eagle3Config, flag_weight_mismatch
from trainer.training.registry import DrafterRecord, load_components


def training_record(
    kind: str, config: Eagle3Config, target: str, target_architectures: list[str], draft_tokens: int
) -> DrafterRecord:
    """The record of a drafter of ``kind`` trained against ``target`` for ``draft_tokens`` drafts per round (EAGLE-3's
    TTT steps, P-EAGLE's depths)."""
    return DrafterRecord(
        kind=kind,
        config=config.to_dict(),
        components={"drafter": "drafter."},
        target=target,
        target_architectures=list(target_architectures or []),
        target_layers=list(config.aux_layers),
        target_vocab_size=config.vocab_size,
        target_hidden_size=config.target_hidden_size,
        tokenizer=target,
        draft_tokens=draft_tokens,
    )


def export_record(
    kind: str, config: Eagle3Config, target: str | None = None, draft_tokens: int | None = None
) -> DrafterRecord:
    """The record of a drafter read back from an export (the target known only to the speculators format)."""
    return DrafterRecord(
        kind=kind,
        config=config.to_dict(),
        target=target,
        target_layers=list(config.aux_layers),
        target_vocab_size=config.vocab_size,
        target_hidden_size=config.target_hidden_size,
        draft_tokens=draft_tokens,
    )


def speculators_verifier(folder: Path) -> tuple[str | None, int | None]:
    """A speculators-format folder's verifier (the target it names) and drafts per round (trainer/export/
    speculators.py reads them)."""
    block = folder_block(folder)
    return block.verifier, block.draft_tokens


def load_weights(drafter: nn.Module, record: DrafterRecord, state: dict, where: str) -> None:
    """A training checkpoint's weights, refused naming the norm flag when they disagree with the record's flags."""
    names = sub_state_dict(state, record.components.get("drafter", "drafter.")).keys()
    problem = flag_weight_mismatch(drafter.config, names)
    if problem:
        raise CheckpointError(f"{where}: the drafter's weights disagree with its recorded config: {problem}")
    load_components(drafter, record, state, where)
