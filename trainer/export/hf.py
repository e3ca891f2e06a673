"""Plain HF checkpoints: distilled draft models (and, later, LayerSkip models).

``save_pretrained`` with safetensors and the tokenizer beside the weights: ``AutoModelForCausalLM.from_pretrained``
loads the result, and HF transformers uses it directly as ``generate(assistant_model=...)``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import PreTrainedModel

from trainer.data.vocab import load_tokenizer_if_present

log = logging.getLogger(__name__)


def save_hf(
    model: PreTrainedModel, out_dir: str, tokenizer_from: str | None, state_dict: dict[str, torch.Tensor] | None = None
) -> Path:
    """Writes the model (safetensors) and, when one is found at ``tokenizer_from``, its tokenizer.

    ``state_dict``: the full weights when the model's own parameters are shards (FSDP2, ZeRO-3).
    """
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True, state_dict=state_dict)
    tokenizer = load_tokenizer_if_present(tokenizer_from) if tokenizer_from else None
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def export_student(objective, student: PreTrainedModel, out_dir: str, tokenizer_from: str | None) -> None:
    """The end-of-fit export of an objective's HF student.

    Under FSDP2 or ZeRO-3 every rank takes part in gathering the full weights; rank zero writes them.
    """
    from trainer.distributed.strategies import full_state_dict

    state = full_state_dict(student) if objective.weights_are_sharded() else None
    if objective.global_rank == 0:
        log.info("student saved to %s", save_hf(student, out_dir, tokenizer_from, state))
