"""The ``dflash2`` export: speculators' DFlash2 format (``speculators_model_type: "dflash2"``, ``DFlash2DraftModel``:
speculators 0.9 ``models/dflash2``), written and read by DFlash's speculators writer and reader
(trainer/methods/dflash/export.py).

The speculators DFlash format plus DFlash2's fields, ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``,
``selector_top_k`` and ``sliding_window_non_causal`` (module.py ``DFLASH2_KEYS``; DFlash2's default of the last is
true), and the convolutions' and selector's weights under speculators' names (``layers.{i}.attention_conv.*``,
``layers.{i}.mlp_conv.*``, ``candidate_selector.*``). A field the file leaves out is read with speculators' default
(module.py ``DFlash2Config``). speculators requires the full vocabulary (``draft_vocab_size`` the verifier's), which
DFlash's writer always writes.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from trainer.methods.dflash import export as dflash_export
from trainer.methods.dflash2.module import DFLASH2_KEYS, DFlash2Config, DFlash2Drafter

MODEL_TYPE = "dflash2"
ARCHITECTURES = ["DFlash2DraftModel"]
DEFAULTS = {f.name: f.default for f in fields(DFlash2Config) if f.name in DFLASH2_KEYS}
"""speculators' ``DFlash2SpeculatorConfig`` defaults of DFlash2's fields, for a file that leaves one out."""


def save_dflash2(
    drafter: DFlash2Drafter,
    out_dir: str,
    verifier: str,
    verifier_architectures: list[str] | None = None,
    dtype: torch.dtype | None = None,
):
    """Write the ``dflash2`` folder (``config.json`` and the weights, convolutions and selector included).

    Args:
        drafter: the drafter.
        out_dir: the folder to write.
        verifier: the target's directory or hub id (speculators rebuilds the embedding and lm_head from it).
        verifier_architectures: the target config's ``architectures``.
        dtype: the weights' dtype in the file (default: the drafter's).
    """
    return dflash_export.save_speculators(
        drafter, out_dir, verifier, verifier_architectures, dtype, MODEL_TYPE, ARCHITECTURES, DFLASH2_KEYS
    )


def load_dflash2(path: str) -> DFlash2Drafter:
    """Read a ``dflash2`` folder by speculators' rules (``DFlash2SpeculatorConfig`` and ``DFlash2DraftModel``): the
    speculators DFlash reader's, with DFlash2's fields at speculators' defaults for those left out."""
    return dflash_export.load_speculators(path, MODEL_TYPE, DFlash2Drafter, DFlash2Config, DEFAULTS)
