"""The speculators format's own block, written and read once for every export in that format (EAGLE-3, P-EAGLE,
DFlash, DSpark and the methods that extend them).

A speculators checkpoint (speculators 0.9 ``SpeculatorModelConfig``) is a ``config.json`` beside one safetensors file
(trainer/export/files.py). Its ``config.json`` opens with three keys every algorithm writes alike:

- ``architectures``: the algorithm's speculator class (``["Eagle3Speculator"]``, ``["DFlashSpeculator"]``...);
- ``speculators_model_type``: the algorithm (``eagle3``, ``peagle``, ``dflash``, ``dspark``), which identifies the
  format of a folder;
- ``speculators_config``: ``algorithm`` (the model type again), ``proposal_methods`` (one greedy method with the
  drafts per round it was trained for, ``speculative_tokens``: vLLM's default ``num_speculative_tokens``),
  ``default_proposal_method`` and ``verifier`` (the target's ``name_or_path``, which speculators reads on every load,
  and its ``architectures``);

then the algorithm's own keys (the method's exporter gives them), and closes with the weights' dtype, as ``dtype``
and as ``torch_dtype`` (older readers' key). :func:`speculators_config` writes it; :func:`read_block` reads the
block back (:func:`folder_block` from a folder), :func:`is_model_type` recognises a folder of one algorithm and
:func:`check_model_type` refuses a folder of another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.export.files import folder_config
from trainer.interface.errors import ModelFolderError

PROPOSAL_TYPE = "greedy"
"""The one proposal method the exports name (speculators' default)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as config.json names it (``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


def speculators_config(
    model_type: str,
    architectures: Sequence[str],
    verifier: str,
    speculative_tokens: int,
    verifier_architectures: Sequence[str] | None,
    fields: dict,
    dtype: torch.dtype,
) -> dict:
    """The ``config.json`` of a speculators checkpoint: the block, the algorithm's ``fields``, the dtype.

    Args:
        model_type: ``speculators_model_type`` and ``speculators_config.algorithm``.
        architectures: the speculator class written as ``architectures``.
        verifier: the target's directory or hub id (refused when empty: speculators reads it on every load).
        speculative_tokens: drafts per round the drafter was trained for (>= 1).
        verifier_architectures: the target config's ``architectures`` (None: none known).
        fields: the algorithm's own keys, written in order after the block.
        dtype: the dtype of the weights in the file.

    Raises:
        ValueError: no verifier, or fewer than one speculative token.
    """
    if not verifier:
        raise ValueError("the speculators format names its verifier (the target): none given")
    if speculative_tokens < 1:
        raise ValueError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    name = dtype_name(dtype)
    return {
        "architectures": list(architectures),
        "speculators_model_type": model_type,
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [{"proposal_type": PROPOSAL_TYPE, "speculative_tokens": speculative_tokens}],
            "default_proposal_method": PROPOSAL_TYPE,
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or [])},
        },
        **fields,
        "dtype": name,
        "torch_dtype": name,
    }


@dataclass(frozen=True)
class SpeculatorsBlock:
    """What a speculators ``config.json`` says in its block (:func:`read_block`).

    Attributes:
        model_type: ``speculators_model_type`` (None when absent: not a speculators folder).
        verifier: the target it names (``speculators_config.verifier.name_or_path``), None when it names none.
        verifier_architectures: the verifier's ``architectures`` as written.
        speculative_tokens: each proposal method's ``speculative_tokens``, as written (a reader checks their range).
    """

    model_type: str | None
    verifier: str | None
    verifier_architectures: list = field(default_factory=list)
    speculative_tokens: list = field(default_factory=list)

    @property
    def draft_tokens(self) -> int | None:
        """The drafts per round of the first proposal method (the one written), None when there is none."""
        return self.speculative_tokens[0] if self.speculative_tokens else None


def read_block(config: dict) -> SpeculatorsBlock:
    """The block of a ``config.json`` (any dict: missing or malformed parts read as absent)."""
    spec = config.get("speculators_config")
    spec = spec if isinstance(spec, dict) else {}
    verifier = spec.get("verifier")
    verifier = verifier if isinstance(verifier, dict) else {}
    methods = spec.get("proposal_methods")
    methods = methods if isinstance(methods, list) else []
    return SpeculatorsBlock(
        model_type=config.get("speculators_model_type"),
        verifier=verifier.get("name_or_path") or None,
        verifier_architectures=list(verifier.get("architectures") or []),
        speculative_tokens=[m.get("speculative_tokens") for m in methods if isinstance(m, dict)],
    )


def folder_block(folder: Path) -> SpeculatorsBlock:
    """The block of a folder's ``config.json``."""
    return read_block(folder_config(folder))


def is_model_type(folder: Path, model_type: str) -> bool:
    """Whether a folder holds a speculators export of ``model_type`` (its ``speculators_model_type``: the key that
    identifies the format, whatever the ``architectures``)."""
    return folder_block(folder).model_type == model_type


def check_model_type(config: dict, model_type: str, where: str) -> None:
    """Refuse a ``config.json`` whose ``speculators_model_type`` is not ``model_type``, naming ``where``."""
    found = config.get("speculators_model_type")
    if found != model_type:
        raise ModelFolderError(f"{where}: speculators_model_type {found!r}, expected {model_type!r}")
