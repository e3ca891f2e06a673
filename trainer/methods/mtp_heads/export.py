"""Export of parallel multi-token-prediction heads: the model as a plain HF checkpoint, the extra heads beside it.

A folder written by :func:`save` holds

- the model as ``save_pretrained`` writes it (``config.json``, ``model.safetensors``, ``generation_config.json``) and
  its tokenizer: trunk + head 0 is the ordinary model, so ``AutoModelForCausalLM.from_pretrained(DIR)`` loads it and
  decodes as the plain next-token model; the extra heads are not in these files (transformers never sees them);
- ``mtp_heads.safetensors``: the extra heads, ``heads.{i}.{name}`` for head ``i = 1 .. n - 1``, ``{name}`` the
  parameter names of the model's own decoder layer class (``self_attn.q_proj.weight``, ``mlp.down_proj.weight``,
  ``input_layernorm.weight``, ...), in the model's dtype;
- ``mtp_heads.json``::

      {"format": "draftsmith-mtp-heads", "version": 1,
       "num_heads": n,                       # heads including head 0
       "head_class": "LlamaDecoderLayer",     # class of every head: type(model.model.layers[-1])
       "hidden_state": L - 1,                 # HF hidden_states index every head reads (the last layer's input)
       "head_0": "model.layers.{L-1}",        # head 0 is the model's last decoder layer
       "shared": ["model.norm", "lm_head"],   # every head's output goes through the model's final norm and lm_head
       "predicts": "head i at position t predicts token t + 1 + i",
       "agreement": [[...], ...] or null,    # [n - 1][R] measured top-k agreement of the extra heads (see below)
       "agreement_count": N,                  # positions it was measured on (0: never)
       "fine_tuned_from": "DIR" or null,      # the model the fine-tune started from (the original target)
       "target_kl_weight": w,                 # the weight of the KL that kept the model close to it (0: none)
       "labels": "data" or "original"}        # what the heads learned: the data's tokens, or that model's outputs

  ``agreement[i - 1][r]``: how often the rank-``r`` token of head ``i`` at position ``t`` was head 0's argmax at
  position ``t + i`` on held-out data (what greedy self-speculative decoding verifies); trees are built from it.

Head ``i`` runs as ``lm_head(norm(layer_i(z, causal mask, rotary positions)))`` on ``z`` = HF ``hidden_states[L - 1]``.
:func:`load` reads the folder back (every tensor of ``mtp_heads.safetensors`` must be consumed, and none may miss).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from trainer.export.hf import save_hf
from trainer.interface.errors import ModelFolderError
from trainer.methods.mtp_heads.module import MTPHeads

FORMAT = "draftsmith-mtp-heads"
VERSION = 1
CONFIG_FILE = "mtp_heads.json"
WEIGHTS_FILE = "mtp_heads.safetensors"


def heads_state_dict(heads: MTPHeads, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The extra heads' tensors under their file names (``heads.{i}.*``, i from 1), from the module or from its full
    state dict (the module's own parameters being shards)."""
    state = state_dict if state_dict is not None else heads.state_dict()
    out = {}
    for key, value in state.items():
        if key.startswith("heads."):
            index, name = key[len("heads.") :].split(".", 1)
            out[f"heads.{int(index) + 1}.{name}"] = value.detach().cpu().contiguous()
    return out


def save(
    heads: MTPHeads,
    out_dir: str | Path,
    tokenizer_from: str | None,
    state_dict: dict[str, torch.Tensor] | None = None,
    fine_tuned_from: str | None = None,
    target_kl_weight: float = 0.0,
    labels: str = "data",
) -> Path:
    """Write the model (HF checkpoint, tokenizer from ``tokenizer_from`` when found) and the extra heads beside it.

    ``state_dict``: the module's full state dict when its own parameters are shards (FSDP2, ZeRO-3).
    ``fine_tuned_from``, ``target_kl_weight``, ``labels``: the model a fine-tune started from, the weight of its KL to
    it and what the heads learned, recorded in ``mtp_heads.json`` (``draftsmith eval --original_target`` compares the
    two models).
    """
    path = Path(out_dir)
    model_state = None
    if state_dict is not None:
        model_state = {k[len("model.") :]: v for k, v in state_dict.items() if k.startswith("model.")}
    save_hf(heads.model, str(path), tokenizer_from, model_state)
    save_file(heads_state_dict(heads, state_dict), str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    agreement = heads.measured_agreement()
    if state_dict is not None and "agreement" in state_dict and float(state_dict["agreement_count"]) > 0:
        agreement = state_dict["agreement"].double()
    L = heads.num_layers
    config = {
        "format": FORMAT,
        "version": VERSION,
        "num_heads": heads.num_heads,
        "head_class": type(heads.head(0)).__name__,
        "hidden_state": L - 1,
        "head_0": f"model.layers.{L - 1}",
        "shared": ["model.norm", "lm_head"],
        "predicts": "head i at position t predicts token t + 1 + i",
        "agreement": None if agreement is None else [[round(float(x), 6) for x in row] for row in agreement],
        "agreement_top_k": int(heads.agreement.shape[1]),
        "agreement_count": float(heads.agreement_count) if agreement is not None else 0.0,
        "fine_tuned_from": fine_tuned_from,
        "target_kl_weight": float(target_kl_weight),
        "labels": labels,
    }
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return path


def read_config(folder: Path) -> dict:
    """``mtp_heads.json`` of an export, checked: the format and version this code writes, a positive head count."""
    path = Path(folder) / CONFIG_FILE
    config = json.loads(path.read_text())
    if config.get("format") != FORMAT or config.get("version") != VERSION:
        raise ModelFolderError(
            f"{path}: format {config.get('format')!r} version {config.get('version')!r}, expected {FORMAT!r} version "
            f"{VERSION}"
        )
    if not isinstance(config.get("num_heads"), int) or config["num_heads"] < 1:
        raise ModelFolderError(f"{path}: num_heads must be a positive integer, got {config.get('num_heads')!r}")
    return config


def is_export(folder: Path) -> bool:
    """A folder :func:`save` wrote (its ``mtp_heads.json`` names the format)."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("format") == FORMAT
    except (json.JSONDecodeError, AttributeError):
        return False


def load(folder: str | Path, dtype: torch.dtype | None = None) -> MTPHeads:
    """The model and its heads from an exported folder; an error naming the file when a head tensor is missing or
    extra, or when the heads were written for another model (head class, hidden state)."""
    folder = Path(folder)
    config = read_config(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, **({"dtype": dtype} if dtype is not None else {}))
    top_k = int(config.get("agreement_top_k") or 1)
    heads = MTPHeads(model, config["num_heads"], head_init="copy", accuracy_top_k=top_k)
    where = folder / CONFIG_FILE
    if config.get("head_class") != type(heads.head(0)).__name__ or config.get("hidden_state") != heads.hidden_layer:
        raise ModelFolderError(
            f"{where}: heads of class {config.get('head_class')!r} reading hidden state {config.get('hidden_state')}, "
            f"the model in {folder} has {type(heads.head(0)).__name__} and reads {heads.hidden_layer}"
        )
    stored = load_file(str(folder / WEIGHTS_FILE)) if heads.num_heads > 1 else {}
    expected = heads_state_dict(heads)
    missing, extra = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
    if missing or extra:
        raise ModelFolderError(f"{folder / WEIGHTS_FILE}: missing {missing[:5]}, unexpected {extra[:5]} head tensors")
    for key, value in stored.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ModelFolderError(
                f"{folder / WEIGHTS_FILE}: {key} has shape {tuple(value.shape)}, the model needs "
                f"{tuple(expected[key].shape)}"
            )
    own = {f"heads.{int(k.split('.')[1]) - 1}.{k.split('.', 2)[2]}": v for k, v in stored.items()}
    heads.load_state_dict(own, strict=False)
    if config.get("agreement") is not None:
        agreement = torch.tensor(config["agreement"], dtype=torch.float64)
        if tuple(agreement.shape) != tuple(heads.agreement.shape):
            raise ModelFolderError(
                f"{where}: agreement of shape {tuple(agreement.shape)}, expected {tuple(heads.agreement.shape)}"
            )
        heads.agreement.copy_(agreement.to(heads.agreement))
        heads.agreement_count.fill_(float(config.get("agreement_count") or 1.0))
    return heads
