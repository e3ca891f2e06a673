"""Drafter kind ``hf_causal_lm``: a separate HF causal LM that drafts autoregressively (distilled draft models).

Trained by the KD and on-policy objectives; exported as a plain HF checkpoint (``hf``) that transformers
(``generate(assistant_model=...)``), vLLM and SGLang load; drafted with :class:`DraftModelProposer`, which keeps the
draft's own KV cache across rounds.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from trainer.data.vocab import TOKENIZER_FILES
from trainer.decoding.options import ProposerOptions
from trainer.export import serving
from trainer.export.hf import save_hf
from trainer.methods.draft_model.proposer import DraftModelProposer
from trainer.training.registry import DrafterKind, DrafterRecord, ExportFormat, register_kind

KIND = "hf_causal_lm"
DEFAULT_DRAFTS = 4  # drafts per round in the serve lines: draftsmith eval --k 1,2,4,8 finds the best for a drafter


def make_record(model: PreTrainedModel, component: str, target: str, target_config) -> DrafterRecord:
    """The record of an HF student trained against ``target`` (its tokenizer is the target's).

    Args:
        model: the student.
        component: its attribute name in the training module (the state-dict prefix without the dot).
        target: the teacher's directory or hub id.
        target_config: the teacher's HF config.
    """
    return DrafterRecord(
        kind=KIND,
        config=model.config.to_dict(),
        components={component: component + "."},
        target=target,
        target_architectures=list(getattr(target_config, "architectures", None) or []),
        target_vocab_size=int(target_config.vocab_size),
        tokenizer=target,
    )


def build(record: DrafterRecord) -> PreTrainedModel:
    """An initialised model of the record's config."""
    config_dict = dict(record.config)
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    return AutoModelForCausalLM.from_config(config)


def write(model: PreTrainedModel, record: DrafterRecord, out_dir: Path) -> Path:
    """``save_pretrained`` with safetensors, and the tokenizer of ``record.tokenizer`` beside it."""
    return save_hf(model, str(out_dir), record.tokenizer)


def recognise(folder: Path) -> bool:
    """A folder with an HF causal-LM config (``architectures`` ``*ForCausalLM``) and safetensors weights."""
    config = folder / "config.json"
    if not config.is_file() or not any((folder / n).is_file() for n in ("model.safetensors", SAFETENSORS_INDEX)):
        return False
    architectures = json.loads(config.read_text()).get("architectures") or []
    return len(architectures) == 1 and architectures[0].endswith("ForCausalLM")


def load(folder: Path) -> tuple[PreTrainedModel, DrafterRecord]:
    """``AutoModelForCausalLM.from_pretrained``; the record's tokenizer is the folder's when it holds one."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    has_tokenizer = any((folder / f).is_file() for f in TOKENIZER_FILES)
    record = DrafterRecord(kind=KIND, config=model.config.to_dict(), tokenizer=str(folder) if has_tokenizer else None)
    return model, record


def proposer(model: PreTrainedModel, record: DrafterRecord, target: PreTrainedModel, options: ProposerOptions):
    """Autoregressive chain drafting with the model's own cache."""
    if options.tree:
        raise ValueError("a draft model (hf_causal_lm) drafts chains only: drop --tree")
    return DraftModelProposer(model)


SAFETENSORS_INDEX = "model.safetensors.index.json"

HF = ExportFormat(
    name="hf",
    description="a plain HF checkpoint: transformers (assistant_model), vLLM and SGLang load it",
    write=write,
    load=load,
    recognise=recognise,
    generic=True,
    serve=lambda folder, record: [
        serving.vllm(record.target, "draft_model", folder, DEFAULT_DRAFTS),
        serving.sglang(record.target, "STANDALONE", folder),
        serving.transformers_assisted(record.target, folder),
    ],
)

register_kind(DrafterKind(name=KIND, build=build, formats=(HF,), proposer=proposer))
