"""P-EAGLE export: the speculators format ``peagle`` (speculators 0.9 ``PEagleSpeculatorConfig``), with its loader.

As the EAGLE-3 speculators format (trainer/methods/eagle3/export.py: ``layers.0.*``, the Llama layer config under
``transformer_layer_config``, the norm flags as trained; with several decoder layers ``layers.{j}.*`` for layer j and
``num_hidden_layers`` in the layer config), with ``speculators_model_type: "peagle"``,
``architectures: ["PEagleSpeculator"]``, ``mask_token_id``, ``embed_requires_grad: true`` (the embedding is trained),
and the drafter's own tensors ``embed_tokens.weight`` (its trained embedding, not the target's) and ``mask_hidden``
[1, 1, n * H] (speculators lists both among the keys it may miss and then keeps uninitialised memory, so both are
always written). ``speculative_tokens`` is the number of depths trained.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.export.files import write_folder
from trainer.interface.errors import ModelFolderError
from trainer.methods.eagle3.export import (
    consume_tensors,
    module_name,
    read_speculators,
    speculators_config,
    speculators_tensors,
)
from trainer.methods.peagle.module import PEagleConfig, PEagleDrafter

MODEL_TYPE = "peagle"
"""The speculators format's ``speculators_model_type``."""
ARCHITECTURES = ["PEagleSpeculator"]


def save_peagle(
    drafter: PEagleDrafter,
    out_dir: str,
    verifier: str,
    speculative_tokens: int,
    verifier_architectures: list[str] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the speculators ``peagle`` checkpoint: the arguments of EAGLE-3's ``save_speculators`` less the
    embedding (the drafter's own is written), ``speculative_tokens`` being the depths trained."""
    config = speculators_config(
        drafter, MODEL_TYPE, ARCHITECTURES, verifier, speculative_tokens, verifier_architectures, dtype
    )
    config["mask_token_id"] = drafter.config.mask_token_id
    config["embed_requires_grad"] = True
    return write_folder(out_dir, config, speculators_tensors(drafter, dtype))


def load_peagle(path: str) -> PEagleDrafter:
    """Read a speculators ``peagle`` export: every tensor consumed, none missing (``embed_tokens.weight`` and
    ``mask_hidden`` included)."""
    config, tensors, shape, layers = read_speculators(path, MODEL_TYPE, "a P-EAGLE export")
    mask_id = config.get("mask_token_id")
    if not isinstance(mask_id, int):
        raise ModelFolderError(f"{path}: mask_token_id must be a token id, got {mask_id!r}")
    drafter = PEagleDrafter(PEagleConfig(**shape.to_dict(), mask_token_id=mask_id, num_layers=layers))
    return consume_tensors(drafter, tensors, module_name, path)
