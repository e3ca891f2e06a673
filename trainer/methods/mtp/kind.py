"""Drafter kind ``mtp``: sequential multi-token-prediction modules on an HF causal LM trunk (module.py).

Trained by objective.py (pre-training with the trunk, refresh and extend on a frozen model). Exported as
the model with its modules in the layout of its architecture (``mtp``: ``nextn`` for DeepSeek-V3, ``qwen3-next``
otherwise), in a named layout, or as the model alone (``hf``); drafted by proposer.py on the
target session's hidden states, with the target's own embedding and lm_head. The record of the modules is
record.py's (re-exported here).
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoModelForCausalLM, PreTrainedModel

from trainer.decoding.options import ProposerOptions
from trainer.export import serving
from trainer.methods.mtp import export as formats
from trainer.methods.mtp.module import MTPConfig, MTPDrafter, text_config
from trainer.methods.mtp.proposer import MTPProposer
from trainer.methods.mtp.record import COMPONENTS, KIND, make_record  # noqa: F401 (the record, re-exported here)
from trainer.training.registry import DrafterKind, DrafterRecord, ExportFormat, register_kind


def build(record: DrafterRecord) -> MTPDrafter:
    """Modules of the record's shape, with an initialised trunk when the record has one."""
    config = MTPConfig(**record.config)
    trunk = AutoModelForCausalLM.from_config(config.trunk_config()) if "trunk" in record.components else None
    return MTPDrafter(config, trunk)


def load_weights(drafter: MTPDrafter, record: DrafterRecord, state: dict, where: str) -> None:
    """Each component's weights, strictly."""
    from trainer.checkpoints.reading import sub_state_dict

    for component, prefix in record.components.items():
        target = getattr(drafter, component)
        missing, unexpected = target.load_state_dict(sub_state_dict(state, prefix), strict=False)
        tied = set((getattr(target, "_tied_weights_keys", None) or {}) if component == "trunk" else ())
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise ValueError(
                f"{where}: {component} weights do not match the record: missing {missing}, extra {unexpected}"
            )
        if tied and hasattr(target, "tie_weights"):
            target.tie_weights()


def proposer(drafter: MTPDrafter, record: DrafterRecord, target: PreTrainedModel, options: ProposerOptions):
    """Chain drafting, or a tree of per-depth top-k candidates with ``options.tree``, on the target's embedding and
    lm_head."""
    layers = int(text_config(target.config).num_hidden_layers)
    return MTPProposer(
        drafter.mtp,
        target.get_input_embeddings(),
        target.get_output_embeddings(),
        layers,
        tree=options.tree,
        tree_nodes=options.tree_nodes,
        tree_top_k=options.tree_top_k,
        rank_temperature=options.rank_temperature,
    )


def write_layout(drafter: MTPDrafter, record: DrafterRecord, out: Path) -> Path:
    """The layout the modules were trained for."""
    writer = formats.write_nextn if drafter.config.layout == "nextn" else formats.write_qwen3_next
    return writer(drafter, record, out)


def load_layout(folder: Path) -> tuple[MTPDrafter, DrafterRecord]:
    """Whichever layout the folder holds."""
    loaded = formats.load_model_modules(str(folder))
    if loaded is None:
        raise ValueError(f"{folder}: no MTP modules in either layout (model.layers.N.eh_proj or mtp.fc)")
    return loaded


def _refuse_plain(folder: Path) -> tuple[MTPDrafter, DrafterRecord]:
    raise ValueError(f"{folder}: a plain HF checkpoint holds no MTP modules to load (kind hf_causal_lm reads it)")


MODEL = ExportFormat(
    name="mtp",
    description="the model with its modules in its architecture's layout (nextn for DeepSeek-V3, qwen3-next else)",
    write=write_layout,
    load=load_layout,
    recognise=lambda folder: False,  # the two layouts below recognise their folders
    serve=lambda folder, record: (NEXTN if formats.recognise_nextn(folder) else QWEN3_NEXT).serve(folder, record),
)
NEXTN = ExportFormat(
    name="nextn",
    description="DeepSeek NextN layout (model.layers.N.*): vLLM and SGLang, DeepSeek-V3-architecture models",
    write=formats.write_nextn,
    load=formats.load_nextn,
    recognise=formats.recognise_nextn,
    serve=lambda folder, record: [
        serving.vllm(str(folder), "mtp", None, None),
        serving.sglang(str(folder), "NEXTN", folder),
    ],
)
QWEN3_NEXT = ExportFormat(
    name="qwen3-next",
    description="Qwen3-Next / Qwen3.5 layout (mtp.fc, mtp.layers.*): vLLM",
    write=formats.write_qwen3_next,
    load=formats.load_qwen3_next,
    recognise=formats.recognise_qwen3_next,
    serve=lambda folder, record: [serving.vllm(str(folder), "mtp", None, None)],
)
HF = ExportFormat(
    name="hf",
    description="the model without its modules, a plain HF checkpoint (transformers)",
    write=formats.write_hf,
    load=_refuse_plain,
    recognise=lambda folder: False,  # a plain HF checkpoint is kind hf_causal_lm's
)

register_kind(
    DrafterKind(
        name=KIND,
        build=build,
        formats=(MODEL, NEXTN, QWEN3_NEXT, HF),
        proposer=proposer,
        load_weights=load_weights,
        carried_target=lambda drafter: drafter.trunk,  # the trunk trained with the modules (pre-training), or None
    )
)
