"""Drafter kind ``mtp_heads``: parallel multi-token-prediction heads trained with the model (module.py,
objective.py), drafting for the model itself (self-speculative decoding).

The drafter is the model with its heads; its target is the same model (trunk + head 0). Export format
``mtp_heads`` (export.py, the layout documented there): the model as a plain HF checkpoint that
transformers loads (heads dropped), plus ``mtp_heads.safetensors`` and ``mtp_heads.json`` beside it. So::

    draftsmith export --ckpt_path CKPT --output_dir DIR
    draftsmith eval --target DIR --drafter DIR --k 3 [--tree --tree_nodes 16]     # n = 4 heads: K = 3 drafts

Drafting (proposer.py): a chain of the extra heads' argmaxes (samples at a temperature),
or with ``--tree`` the tree of per-head top-k paths that :func:`~trainer.decoding.head_tree.tree_for_budget` builds
for ``--tree_nodes`` from the heads' measured agreement with head 0 (recorded at validation; a prior
:func:`module.default_accuracy` when never measured), ranks below ``--tree_top_k``. The proposer
refuses a target whose weights are not the model's the heads were trained with (they read its hidden states and
share its norm and lm_head).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from trainer.decoding.head_tree import tree_for_budget
from trainer.decoding.options import ProposerOptions
from trainer.export import serving
from trainer.methods.mtp_heads import export as formats
from trainer.methods.mtp_heads.module import ACCURACY_TOP_K, MTPHeads, default_accuracy
from trainer.methods.mtp_heads.proposer import MTPHeadsProposer
from trainer.training.registry import DrafterKind, DrafterRecord, ExportFormat, register_kind

KIND = "mtp_heads"


def make_record(
    heads: MTPHeads,
    component: str,
    target: str | None,
    tokenizer: str | None,
    fine_tuned_from: str | None = None,
    target_kl_weight: float = 0.0,
    labels: str = "data",
) -> DrafterRecord:
    """The record of a model trained with parallel heads.

    Args:
        heads: the model and its heads.
        component: its attribute name in the training module (the state-dict prefix without the dot).
        target: where the trained model is saved (it is its own target), when known.
        tokenizer: the tokenizer directory, when known.
        fine_tuned_from: the model a fine-tune started from (the original target), None for a fresh model.
        target_kl_weight: the weight of the KL that kept the model close to that original (0: none).
        labels: what the heads learned: "data" (the rows' tokens) or "original" (that original's distribution).
    """
    config = heads.model.config
    return DrafterRecord(
        kind=KIND,
        config={
            "num_heads": heads.num_heads,
            "agreement_top_k": int(heads.agreement.shape[1]),
            "model_config": config.to_dict(),
            "fine_tuned_from": fine_tuned_from,
            "target_kl_weight": float(target_kl_weight),
            "labels": labels,
        },
        components={component: component + "."},
        target=target,
        target_architectures=list(getattr(config, "architectures", None) or [type(heads.model).__name__]),
        target_layers=[heads.hidden_layer],
        target_vocab_size=int(config.vocab_size),
        target_hidden_size=int(config.hidden_size),
        tokenizer=tokenizer,
        draft_tokens=heads.num_heads - 1,
    )


def build(record: DrafterRecord) -> MTPHeads:
    """An initialised model with heads of the record's shape (weights loaded after)."""
    config_dict = dict(record.config["model_config"])
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    model = AutoModelForCausalLM.from_config(config)
    top_k = int(record.config.get("agreement_top_k", ACCURACY_TOP_K))
    return MTPHeads(model, int(record.config["num_heads"]), head_init="copy", accuracy_top_k=top_k)


def load_weights(module: MTPHeads, record: DrafterRecord, state: dict, where: str) -> None:
    """A training checkpoint's weights, strictly (a tied lm_head may be stored once, as the embedding)."""
    from trainer.checkpoints.reading import sub_state_dict

    ((_, prefix),) = record.components.items()
    missing, unexpected = module.load_state_dict(sub_state_dict(state, prefix), strict=False)
    if getattr(module.model.config, "tie_word_embeddings", False):
        missing = [k for k in missing if k != "model.lm_head.weight"]
        module.model.tie_weights()
    if missing or unexpected:
        raise ValueError(f"{where}: weights do not match the drafter record: missing {missing}, extra {unexpected}")


def write(module: MTPHeads, record: DrafterRecord, out_dir: Path) -> Path:
    """The model as an HF checkpoint with its tokenizer, the heads beside it (export.py)."""
    settings = record.config
    return formats.save(
        module, out_dir, record.tokenizer, None, settings.get("fine_tuned_from"), settings.get("target_kl_weight", 0.0),
        settings.get("labels", "data"),
    )  # fmt: skip


def load(folder: Path) -> tuple[MTPHeads, DrafterRecord]:
    """An exported folder; the record's target and tokenizer are the folder itself."""
    module = formats.load(folder)
    tokenizer = str(folder) if (folder / "tokenizer_config.json").is_file() else None
    settings = formats.read_config(folder)
    return module, make_record(
        module, "mtp", str(folder), tokenizer, settings.get("fine_tuned_from"), settings.get("target_kl_weight", 0.0),
        settings.get("labels", "data"),
    )  # fmt: skip


def same_model(heads: MTPHeads, target: PreTrainedModel) -> bool:
    """True when ``target`` has exactly the weights of the model the heads were trained with."""
    if target is heads.model:
        return True
    own, other = heads.model.state_dict(), target.state_dict()
    if own.keys() != other.keys():
        return False
    return all(torch.equal(own[k], other[k].to(device=own[k].device, dtype=own[k].dtype)) for k in own)


def proposer(heads: MTPHeads, record: DrafterRecord, target: PreTrainedModel, options: ProposerOptions):
    """The chain of the extra heads, or with ``options.tree`` the tree of per-head top-k paths for the node budget."""
    if options.exit_layer is not None:
        raise ValueError("parallel MTP heads draft from the last layer's input, not from an early exit: drop "
                         "--exit_layer")  # fmt: skip
    if not same_model(heads, target):
        raise ValueError(
            "the MTP heads read the target's hidden states and share its final norm and lm_head, but the target's "
            "weights are not those of the model they were trained with: pass that model (the export folder) as "
            "--target"
        )
    choices = None
    if options.tree:
        drafts = heads.num_heads - 1
        measured = heads.measured_agreement()
        top_k = max(1, min(options.tree_top_k, heads.agreement.shape[1]))
        accuracy = measured[:, :top_k] if measured is not None else default_accuracy(drafts, top_k)
        choices = tree_for_budget(accuracy, options.tree_nodes)
    return MTPHeadsProposer(heads, choices)


MTP_HEADS = ExportFormat(
    name="mtp_heads",
    description="the model as a plain HF checkpoint (transformers loads it) with mtp_heads.safetensors and "
    "mtp_heads.json beside it: draftsmith eval drafts with the heads",
    write=write,
    load=load,
    recognise=formats.is_export,
    serve=lambda folder, record: [serving.NO_ENGINE],
)

register_kind(DrafterKind(name=KIND, build=build, formats=(MTP_HEADS,), proposer=proposer, load_weights=load_weights))
