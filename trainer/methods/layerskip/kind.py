"""Drafter kind ``layerskip``: a causal LM trained with layer dropout and early-exit losses (objective.py)
that drafts for itself with its first E layers.

Exported as a plain HF checkpoint (transformers, vLLM and SGLang load it; transformers drafts with it through
``generate(assistant_early_exit=E)``) with ``layerskip.json`` beside it (how it was trained), which is how a folder
is recognised as this kind rather than as a separate draft model. Drafted by the early-exit proposer
(proposer.py) with ``--exit_layer E``, through the target session: pass the same folder as
``--target``.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from trainer.decoding.options import ProposerOptions
from trainer.export.hf import save_hf
from trainer.methods.layerskip.proposer import EarlyExitProposer
from trainer.training.registry import DrafterKind, DrafterRecord, ExportFormat, register_kind

KIND = "layerskip"
MARKER = "layerskip.json"


def make_record(
    model: PreTrainedModel,
    tokenizer: str | None,
    exits: list[int],
    p_max: float,
    dropout_scale: str,
    fine_tuned_from: str | None = None,
    target_kl_weight: float = 0.0,
    labels: str = "data",
):
    """The record of a model trained with early exits at ``exits`` and layer dropout up to ``p_max``; a fine-tune
    records the model it started from (``fine_tuned_from``, the original target), the weight of its KL to it and what
    its exits learned (``labels``: the data or the original's distribution)."""
    return DrafterRecord(
        kind=KIND,
        config={
            "model": model.config.to_dict(),
            "early_exit_layers": list(exits),
            "p_max": p_max,
            "dropout_scale": dropout_scale,
            "fine_tuned_from": fine_tuned_from,
            "target_kl_weight": float(target_kl_weight),
            "labels": labels,
        },
        components={"model": "net.model."},
        target_vocab_size=int(model.config.vocab_size),
        tokenizer=tokenizer,
    )


def write_marker(record: DrafterRecord, folder: str | Path) -> None:
    """``layerskip.json`` beside an exported model: its training settings (all but the model config)."""
    settings = {k: v for k, v in record.config.items() if k != "model"}
    (Path(folder) / MARKER).write_text(json.dumps({"kind": KIND, **settings}, indent=2) + "\n")


def build(record: DrafterRecord) -> PreTrainedModel:
    config_dict = dict(record.config["model"])
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    return AutoModelForCausalLM.from_config(config)


def write(model: PreTrainedModel, record: DrafterRecord, out: Path) -> Path:
    path = save_hf(model, str(out), record.tokenizer)
    write_marker(record, path)
    return path


def load(folder: Path) -> tuple[PreTrainedModel, DrafterRecord]:
    model = AutoModelForCausalLM.from_pretrained(folder)
    settings = json.loads((folder / MARKER).read_text())
    settings.pop("kind", None)
    record = DrafterRecord(
        kind=KIND, config={"model": model.config.to_dict(), **settings}, target_vocab_size=model.config.vocab_size
    )
    return model, record


def proposer(model: PreTrainedModel, record: DrafterRecord, target: PreTrainedModel, options: ProposerOptions):
    """Early exit at ``options.exit_layer`` through the target session (the target is this model)."""
    if options.exit_layer is None:
        layers = int(record.config["model"]["num_hidden_layers"])
        raise ValueError(f"a LayerSkip model drafts with its first E layers: give --exit_layer E in 1..{layers - 1}")
    return EarlyExitProposer.from_options(target, options)


HF = ExportFormat(
    name="hf",
    description="a plain HF checkpoint with layerskip.json: transformers (assistant_early_exit), vLLM, SGLang",
    write=write,
    load=load,
    recognise=lambda folder: (folder / MARKER).is_file() and (folder / "config.json").is_file(),
)

register_kind(DrafterKind(name=KIND, build=build, formats=(HF,), proposer=proposer))
