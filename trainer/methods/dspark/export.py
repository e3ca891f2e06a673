"""The ``dspark`` export: speculators' DSpark format (``speculators_model_type: "dspark"``, ``DSparkSpeculator``:
speculators 0.9 ``models/dspark``), written and read by DFlash's speculators writer and reader
(trainer/methods/dflash/export.py).

The speculators DFlash format plus the heads' four fields, ``markov_rank``, ``markov_head_type``,
``enable_confidence_head`` and ``confidence_head_with_markov`` (module.py ``HEAD_KEYS``), and the heads' weights under
speculators' names (heads.py); ``sample_from_anchor`` is written false (DSpark's default is true: the anchor slot
drafting the first token, which draftsmith does not implement, so a DSpark folder without the key is refused by
name). A field the file leaves out is read with speculators' default (module.py ``DSparkConfig``).
"""

from __future__ import annotations

from dataclasses import fields

import torch

from trainer.methods.dflash import export as dflash_export
from trainer.methods.dspark.module import HEAD_KEYS, DSparkConfig, DSparkDrafter

MODEL_TYPE = "dspark"
ARCHITECTURES = ["DSparkSpeculator"]
DEFAULTS = {f.name: f.default for f in fields(DSparkConfig) if f.name in HEAD_KEYS}
"""speculators' ``DSparkSpeculatorConfig`` defaults of the heads' fields, for a file that leaves one out."""


def save_dspark(
    drafter: DSparkDrafter,
    out_dir: str,
    verifier: str,
    verifier_architectures: list[str] | None = None,
    dtype: torch.dtype | None = None,
):
    """Write the ``dspark`` folder (``config.json`` and the weights, heads included).

    Args:
        drafter: the drafter.
        out_dir: the folder to write.
        verifier: the target's directory or hub id (speculators rebuilds the embedding and lm_head from it).
        verifier_architectures: the target config's ``architectures``.
        dtype: the weights' dtype in the file (default: the drafter's).
    """
    return dflash_export.save_speculators(
        drafter, out_dir, verifier, verifier_architectures, dtype, MODEL_TYPE, ARCHITECTURES, HEAD_KEYS
    )


def load_dspark(path: str) -> DSparkDrafter:
    """Read a ``dspark`` folder by speculators' rules (``DSparkSpeculatorConfig`` and ``DSparkDraftModel``): the
    speculators DFlash reader's, the heads' fields with speculators' defaults for those left out, and
    ``sample_from_anchor`` true when absent (refused by name)."""
    return dflash_export.load_speculators(path, MODEL_TYPE, DSparkDrafter, DSparkConfig, DEFAULTS, True)
