"""Drafter kind ``medusa``: K Medusa heads on the target's final normed hidden state (module.py),
and for Medusa-2 the target trained with them.

Exported for vLLM (``medusa``) or the original Medusa / TGI layout (``medusa-tgi``), with a Medusa-2 drafter's trained
target beside the heads (export.py); drafted as the heads' argmax chain, or with ``--tree`` as a tree
of top-k paths (``--tree_choices FILE``; the Medusa paper's 63-node tree for 4 heads by default; ``draftsmith eval
--write_tree FILE`` builds one for a node budget from the heads' measured top-k accuracy).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from trainer.checkpoints.reading import sub_state_dict
from trainer.decoding.head_tree import tree_or_default
from trainer.decoding.options import ProposerOptions
from trainer.export import serving
from trainer.export.files import folder_config
from trainer.methods.medusa import export as formats
from trainer.methods.medusa.module import MedusaConfig, MedusaDrafter
from trainer.methods.medusa.proposer import MedusaProposer
from trainer.training.registry import DrafterKind, DrafterRecord, ExportFormat, register_kind

KIND = "medusa"


def make_record(config: MedusaConfig, target: str, target_config) -> DrafterRecord:
    """The record of heads trained against ``target`` (and, for Medusa-2, of the target trained with them)."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    return DrafterRecord(
        kind=KIND,
        config=config.to_dict(),
        components={"drafter": "drafter."},
        target=target,
        target_architectures=list(getattr(target_config, "architectures", None) or []),
        target_layers=[int(text.num_hidden_layers)],
        target_vocab_size=config.vocab_size,
        target_hidden_size=config.hidden_size,
        tokenizer=target,
        draft_tokens=config.num_heads,
    )


def record_of(drafter: MedusaDrafter, target: str | None = None) -> DrafterRecord:
    """The record of heads read back from an export."""
    c = drafter.config
    return DrafterRecord(
        kind=KIND,
        config=c.to_dict(),
        target=target,
        target_vocab_size=c.vocab_size,
        target_hidden_size=c.hidden_size,
        draft_tokens=c.num_heads,
    )


def build(record: DrafterRecord) -> MedusaDrafter:
    """Heads of the record's shape; for Medusa-2, with the original target loaded from the record's path (the
    layers a run did not train are not in its checkpoint under DeepSpeed)."""
    config = MedusaConfig(**record.config)
    model = None
    if config.with_target:
        if not record.target:
            raise ValueError("a Medusa-2 record names no target to rebuild the trained target from")
        model = AutoModelForCausalLM.from_pretrained(record.target)
    return MedusaDrafter(config, model)


def load_weights(module: MedusaDrafter, record: DrafterRecord, state: dict, where: str) -> None:
    """The checkpoint's weights: every head weight, and the target's (those missing from the checkpoint were frozen
    during training and come from the target's path)."""
    (prefix,) = record.components.values()
    missing, unexpected = module.load_state_dict(sub_state_dict(state, prefix), strict=False)
    missing = [k for k in missing if not (module.model is not None and k.startswith("model."))]
    if missing or unexpected:
        raise ValueError(f"{where}: weights do not match the drafter record: missing {missing}, extra {unexpected}")


def proposer(module: MedusaDrafter, record: DrafterRecord, target: PreTrainedModel, options: ProposerOptions):
    """The heads' argmax chain, or a tree (``options.tree_choices``, the paper's tree for 4 heads)."""
    choices = tree_or_default(options.tree_choices, module.config.num_heads, "heads") if options.tree else None
    return MedusaProposer(module.heads, int(target.config.num_hidden_layers), choices)


def _load_vllm(folder: Path) -> tuple[MedusaDrafter, DrafterRecord]:
    drafter = formats.load_vllm(str(folder))
    return drafter, record_of(drafter)


def _load_tgi(folder: Path) -> tuple[MedusaDrafter, DrafterRecord]:
    drafter = formats.load_tgi(str(folder))
    return drafter, record_of(drafter, folder_config(folder).get("base_model_name_or_path"))


def _write_vllm(module: nn.Module, record: DrafterRecord, out: Path) -> Path:
    return formats.save_vllm(module, str(out), record.tokenizer)


def _write_tgi(module: nn.Module, record: DrafterRecord, out: Path) -> Path:
    if not record.target:
        raise ValueError("the Medusa / TGI format names the base model: the drafter record has no target")
    return formats.save_tgi(module, str(out), record.target, record.tokenizer)


VLLM = ExportFormat(
    name="medusa",
    description="vLLM MedusaModel (vLLM 0.32 and older; num_speculative_tokens equal to the heads)",
    write=_write_vllm,
    load=_load_vllm,
    recognise=lambda folder: folder_config(folder).get("architectures") == ["MedusaModel"],
    serve=lambda folder, record: [
        serving.vllm(
            record.target, "medusa", folder, record.config["num_heads"], version="vLLM 0.32 (0.33 removed Medusa)"
        )
    ],
)
TGI = ExportFormat(
    name="medusa-tgi",
    description="the original Medusa / TGI layout (medusa_lm_head.safetensors)",
    write=_write_tgi,
    load=_load_tgi,
    recognise=lambda folder: "medusa_num_heads" in folder_config(folder) and (folder / formats.TGI_WEIGHTS).is_file(),
    serve=lambda folder, record: [serving.tgi(folder)],
)

register_kind(
    DrafterKind(
        name=KIND,
        build=build,
        formats=(VLLM, TGI),
        proposer=proposer,
        load_weights=load_weights,
        carried_target=lambda drafter: drafter.model,  # Medusa-2's trained target (None for Medusa-1)
    )
)
