"""The record of MTP modules (kind ``mtp``): what the kind (kind.py), the objective and the loaders of exported
checkpoints (export.py) write into checkpoints and read back. Below all three, so that each of them imports it and
none imports another for it."""

from __future__ import annotations

from trainer.methods.mtp.module import MTPConfig, text_config
from trainer.training.registry import DrafterRecord

KIND = "mtp"
COMPONENTS = {"mtp": "drafter.mtp.", "trunk": "drafter.trunk."}
"""Component -> state-dict prefix in a training checkpoint (the objective's ``drafter`` attribute)."""


def make_record(
    config: MTPConfig,
    target: str | None,
    target_architectures: list[str],
    with_trunk: bool,
    tokenizer: str | None,
) -> DrafterRecord:
    """The record of MTP modules.

    Args:
        config: the modules' config.
        target: the frozen model they draft for (refresh, extend), or None when the trunk is in the checkpoint.
        target_architectures: the trunk config's ``architectures``.
        with_trunk: the checkpoint holds the trunk (pre-training mode).
        tokenizer: the tokenizer's directory or hub id.
    """
    text = text_config(config.trunk_config())
    layer = int(text.num_hidden_layers) if config.trunk_hidden == "after_norm" else -1  # -1: FINAL_PRENORM
    components = dict(COMPONENTS) if with_trunk else {"mtp": COMPONENTS["mtp"]}
    return DrafterRecord(
        kind=KIND,
        config=config.to_dict(),
        components=components,
        target=target,
        target_architectures=list(target_architectures or []),
        target_layers=[layer],
        target_vocab_size=int(text.vocab_size),
        target_hidden_size=int(text.hidden_size),
        tokenizer=tokenizer,
        draft_tokens=config.depth,
    )
