"""The commands that serve an export, which ``draftsmith export`` prints after writing it (each format's ``serve``).

Every flag and key was read in the engines' released source (none of these engines runs on the CPU machines the
tests run on, so no test serves an export; tests check the lines against what is written here):

- vLLM 0.34.0 (``vllm/config/speculative.py``, ``vllm/engine/arg_utils.py``, ``vllm/v1/worker/gpu/spec_decode/``):
  ``vllm serve TARGET --speculative-config JSON`` with ``method`` one of ``eagle3``, ``dflash``, ``mtp``,
  ``draft_model`` (and others), ``model`` the draft folder and ``num_speculative_tokens``. A native EAGLE-3 folder
  needs ``"method": "eagle3"`` (vLLM guesses it only from "eagle3" in the folder's name, else falls back to
  ``draft_model``). MTP layers inside the target need no ``model`` (the target's own). vLLM 0.33 removed Medusa (0.32
  serves it with ``"method": "medusa"``), and 0.34 refuses P-EAGLE (0.27 to 0.33 serve its speculators folder as the
  model: ``vllm serve DRAFT``, method and target read from its config).
- SGLang 0.5.23 (``sglang/srt/arg_groups/fields/spec.py``, ``speculative_hook.py``): ``python -m
  sglang.launch_server --model-path TARGET --speculative-algorithm ALGO --speculative-draft-model-path DRAFT``, ALGO
  ``EAGLE3`` (native EAGLE-3), ``DFLASH`` (z-lab DFlash), ``NEXTN`` (MTP layers in the target), ``STANDALONE`` (a
  separate draft model). SGLang reads no speculators-format folder and has no Medusa.
- transformers 5.25.0 (``generation/utils.py``): ``model.generate(**inputs, assistant_model=draft)``.
- TGI (``server/text_generation_server/models/__init__.py``): ``text-generation-launcher --model-id MEDUSA_FOLDER``;
  the folder's config names the base model (``base_model_name_or_path``).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

VLLM = "vLLM 0.34"
SGLANG = "SGLang 0.5.23"
TRANSFORMERS = "transformers 5.25"
TGI = "TGI 3.3"

TARGET_PLACEHOLDER = "TARGET"  # a drafter whose record names no target


def _q(text: str | Path) -> str:
    return shlex.quote(str(text))


def vllm(target: str | None, method: str, draft: Path | None, tokens: int | None, version: str = VLLM) -> str:
    """``vllm serve`` with a ``--speculative-config`` of ``method`` (the draft folder as ``model`` unless None, the
    target's own layers; ``num_speculative_tokens`` unless None)."""
    config: dict[str, object] = {"method": method}
    if draft is not None:
        config["model"] = str(draft)
    if tokens is not None:
        config["num_speculative_tokens"] = tokens
    return f"{version}: vllm serve {_q(target or TARGET_PLACEHOLDER)} --speculative-config {_q(json.dumps(config))}"


def vllm_speculators(draft: Path, version: str) -> str:
    """``vllm serve`` of a speculators folder alone: vLLM reads the method, the drafts per round and the target from
    its config."""
    return f"{version}: vllm serve {_q(draft)}"


def sglang(target: str | None, algorithm: str, draft: Path) -> str:
    """SGLang's server with ``--speculative-algorithm`` ``algorithm`` and the draft folder."""
    return (
        f"{SGLANG}: python -m sglang.launch_server --model-path {_q(target or TARGET_PLACEHOLDER)} "
        f"--speculative-algorithm {algorithm} --speculative-draft-model-path {_q(draft)}"
    )


def transformers_assisted(target: str | None, draft: Path) -> str:
    """transformers' assisted generation with the draft model."""
    load = "AutoModelForCausalLM.from_pretrained"
    return (
        f"{TRANSFORMERS}: {load}({str(target or TARGET_PLACEHOLDER)!r}).generate(**inputs, "
        f"assistant_model={load}({str(draft)!r}))"
    )


def tgi(folder: Path) -> str:
    """TGI serving a Medusa folder (its config names the base model)."""
    return f"{TGI}: text-generation-launcher --model-id {_q(folder)}"


NO_ENGINE = "no serving engine loads this format: measure it with draftsmith eval"
