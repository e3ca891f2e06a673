"""The ``domino`` export: SpecForge's Domino checkpoint layout (``DominoDraftModel``, SpecForge
``configs/qwen3-8b-domino.json``), written and read by DFlash's z-lab writer and reader (trainer/methods/dflash/
export.py) under its own ``architectures``.

The z-lab DFlash ``config.json`` with ``architectures: ["DominoDraftModel"]``, and in ``dflash_config`` beside
``mask_token_id``, ``target_layer_ids`` and ``block_size``: ``projector_type: "domino"``, ``emb_dim``,
``gru_hidden_dim``, ``pure_draft_prefix_len`` and ``shift_label: false`` (``emb_dim`` also at the top level, as
SpecForge's config and SGLang's fallback have it). Weights: the z-lab DFlash names plus the head's under SpecForge's
names (``prefix_gru.weight_ih_l0``, ``prefix_gru.weight_hh_l0``, ``embed_proj.0.weight``, ``embed_proj.2.weight``),
no embedding and no lm_head (the target's). SpecForge's ``auto_map`` (its modelling file) is not written: no such
file is in the folder.

The reader follows SpecForge's ``DominoDraftModel``: ``projector_type`` must be ``domino``, ``emb_dim`` and
``gru_hidden_dim`` are required (``emb_dim`` from the top level when ``dflash_config`` lacks it, refused when the two
differ), ``pure_draft_prefix_len`` absent is 0, and ``shift_label: true`` (the anchor slot drafting the first token,
SpecForge's Qwen3-8B setting) is refused by name: draftsmith's DFlash slots 1..b-1 draft.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.export.files import cpu_tensors, folder_config, write_folder
from trainer.interface.errors import ModelFolderError
from trainer.methods.dflash import export as dflash_export
from trainer.methods.domino.module import DominoConfig, DominoDrafter

ARCHITECTURES = ["DominoDraftModel"]
PROJECTOR_TYPE = "domino"


def save_domino(drafter: DominoDrafter, out_dir: str, dtype: torch.dtype | None = None) -> Path:
    """Write the ``domino`` folder (``config.json`` and the weights, the head's included).

    Args:
        drafter: the drafter.
        out_dir: the folder to write.
        dtype: the weights' dtype in the file (default: the drafter's).
    """
    c = drafter.config
    dflash_export.refuse_sliding_zlab(c)
    config = dflash_export.zlab_config(c, str(dtype or drafter.fc.weight.dtype).removeprefix("torch."))
    config["architectures"] = ARCHITECTURES
    config["emb_dim"] = c.emb_dim
    config["dflash_config"].update(projector_type=PROJECTOR_TYPE, **c.head(), shift_label=False)
    return write_folder(out_dir, config, cpu_tensors(drafter, dtype))


def load_domino(path: str) -> DominoDrafter:
    """Read a ``domino`` folder by SpecForge's rules (``DominoDraftModel``)."""
    config = folder_config(Path(path))
    dflash = config.get("dflash_config") or {}
    if dflash.get("projector_type") != PROJECTOR_TYPE:
        raise ModelFolderError(
            f"{path}: dflash_config.projector_type {dflash.get('projector_type')!r}, expected {PROJECTOR_TYPE!r}"
        )
    if dflash.get("shift_label", False) is not False:
        raise ModelFolderError(
            f"{path}: dflash_config.shift_label {dflash['shift_label']!r}: the anchor slot drafting the first token is "
            "not implemented by draftsmith's DFlash drafter and proposer (slots 1..b-1 draft)"
        )
    top, inner = config.get("emb_dim"), dflash.get("emb_dim")
    if top is not None and inner is not None and top != inner:
        raise ModelFolderError(f"{path}: emb_dim {top} and dflash_config.emb_dim {inner} differ")
    fields = {"emb_dim": top, "gru_hidden_dim": None, "pure_draft_prefix_len": 0}  # absent: SpecForge's reading
    return dflash_export.load_zlab(path, "dflash", ARCHITECTURES, DominoDrafter, DominoConfig, fields)
