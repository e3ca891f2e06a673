"""The ``xpress`` export: speculators' XPress format (``speculators_model_type: "xpress"``, ``XPressSpeculator``:
speculators 0.9 ``models/xpress``), written and read by DFlash's speculators writer and reader
(trainer/methods/dflash/export.py).

The speculators DFlash format plus the refiner's three fields, ``xpress_rank``, ``xpress_mlp_ratio`` and
``num_jacobi_passes`` (module.py ``REFINER_KEYS``), and the refiner's weights under speculators' names
(``refiner_head.token_embed.weight`` [V, r], ``refiner_head.down_h.weight`` and ``down_g.weight`` [r, H],
``in_proj.weight`` [r, 3r], ``mix_l`` [r, b, b], ``mlp_gate.weight`` and ``mlp_up.weight`` [r * ratio, r],
``mlp_down.weight`` [r, r * ratio], ``readout.weight`` [V, r]: head.py). ``sample_from_anchor`` is written false,
XPress's own default (the fill-in layout: slot 0 the anchor, slots 1..b-1 drafting), so a file without the key reads
as draftsmith's layout; true is refused by name. A field the file leaves out is read with speculators' default
(module.py ``XPressConfig``).
"""

from __future__ import annotations

from dataclasses import fields

import torch

from trainer.methods.dflash import export as dflash_export
from trainer.methods.xpress.module import REFINER_KEYS, XPressConfig, XPressDrafter

MODEL_TYPE = "xpress"
ARCHITECTURES = ["XPressSpeculator"]
DEFAULTS = {f.name: f.default for f in fields(XPressConfig) if f.name in REFINER_KEYS}
"""speculators' ``XPressSpeculatorConfig`` defaults of the refiner's fields, for a file that leaves one out."""


def save_xpress(
    drafter: XPressDrafter,
    out_dir: str,
    verifier: str,
    verifier_architectures: list[str] | None = None,
    dtype: torch.dtype | None = None,
):
    """Write the ``xpress`` folder (``config.json`` and the weights, the refiner's included).

    Args:
        drafter: the drafter.
        out_dir: the folder to write.
        verifier: the target's directory or hub id (speculators rebuilds the embedding and lm_head from it).
        verifier_architectures: the target config's ``architectures``.
        dtype: the weights' dtype in the file (default: the drafter's).
    """
    return dflash_export.save_speculators(
        drafter, out_dir, verifier, verifier_architectures, dtype, MODEL_TYPE, ARCHITECTURES, REFINER_KEYS
    )


def load_xpress(path: str) -> XPressDrafter:
    """Read an ``xpress`` folder by speculators' rules (``XPressSpeculatorConfig`` and ``XPressDraftModel``): the
    speculators DFlash reader's, the refiner's fields with speculators' defaults for those left out, and
    ``sample_from_anchor`` false when absent (XPress's default)."""
    return dflash_export.load_speculators(path, MODEL_TYPE, XPressDrafter, XPressConfig, DEFAULTS, False)
