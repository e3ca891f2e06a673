"""DFlash exports: the z-lab format (SGLang, vLLM and the z-lab ``dflash`` package) and the speculators format, with
loaders that follow each reader's rules.

z-lab format (``DFlashDraftModel``): a Qwen3 ``config.json`` of the draft layers (``num_hidden_layers`` is the number
of draft layers) plus ``block_size`` (written at the top level and in ``dflash_config``: SGLang and the package read
the latter first), ``num_target_layers`` and ``dflash_config`` {``mask_token_id``, ``target_layer_ids``,
``block_size``}. ``target_layer_ids`` count outputs of layers from 0 (the package reads ``hidden_states[id + 1]``;
SGLang captures the output of layer ``id``; vLLM, which captures inputs of layers, adds one to them unless a
top-level ``eagle_aux_hidden_state_layer_ids`` is given, which it reads verbatim and which this writer leaves out).
Weights without prefix: ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
``fc.weight`` [H, m * H], ``hidden_norm.weight``, ``norm.weight``. No embedding and no lm_head: every reader uses the
target's (the mask token's row included).

Speculators format (``DFlashSpeculator``, ``speculators_model_type: "dflash"``): the same weights, the Qwen3 layer
config under ``transformer_layer_config``, ``block_size``, ``mask_token_id``, ``aux_hidden_state_layer_ids`` in HF
``hidden_states`` indices (z-lab ids + 1), the full vocabulary as ``draft_vocab_size`` (no ``d2t``/``t2d``, no
lm_head: speculators takes the verifier's for a full-vocabulary draft) and ``speculators_config`` naming the
verifier and ``block_size - 1`` speculative tokens.

Every loader maps each tensor of the file to a drafter parameter and fails on a tensor it does not consume (an
embedding or lm_head included), a missing parameter, a shape that differs, layer ids outside the target, or two
block sizes that disagree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch

from trainer.export.files import cpu_tensors, read_folder, write_folder
from trainer.methods.dflash.module import DFlashConfig, DFlashDrafter

ZLAB_ARCHITECTURES = ["DFlashDraftModel"]
SPECULATORS_ARCHITECTURES = ["DFlashSpeculator"]
Reading = Literal["vllm", "sglang", "dflash"]


def _layer_keys(c: DFlashConfig) -> dict:
    """The Qwen3 keys of the draft layers (both formats)."""
    rope = dict(c.rope_parameters)
    keys = {
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_parameters": rope,
        "rope_theta": rope.get("rope_theta", 10000.0),  # older readers
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * c.num_hidden_layers,
    }
    if rope.get("rope_type", "default") != "default":
        keys["rope_scaling"] = rope
    return keys


def save_zlab(drafter: DFlashDrafter, out_dir: str, dtype: torch.dtype | None = None) -> Path:
    """Write the z-lab checkpoint (``DFlashDraftModel``: SGLang, vLLM, ``DFlashDraftModel.from_pretrained``)."""
    c = drafter.config
    dtype_name = str(dtype or drafter.fc.weight.dtype).removeprefix("torch.")
    config = {
        "architectures": ZLAB_ARCHITECTURES,
        **_layer_keys(c),
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": {
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": c.zlab_layer_ids,
            "block_size": c.block_size,
        },
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }
    return write_folder(out_dir, config, cpu_tensors(drafter, dtype))


def save_speculators(
    drafter: DFlashDrafter,
    out_dir: str,
    verifier: str,
    verifier_architectures: list[str] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the speculators-format checkpoint (``DFlashSpeculator``).

    Args:
        drafter: the drafter.
        out_dir: the folder to write.
        verifier: the target's directory or hub id (speculators rebuilds the embedding and lm_head from it).
        verifier_architectures: the target config's ``architectures``.
        dtype: the weights' dtype in the file (default: the drafter's).
    """
    if not verifier:
        raise ValueError("the speculators format names its verifier (the target): none given")
    c = drafter.config
    dtype_name = str(dtype or drafter.fc.weight.dtype).removeprefix("torch.")
    config = {
        "architectures": SPECULATORS_ARCHITECTURES,
        "speculators_model_type": "dflash",
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or [])},
        },
        "transformer_layer_config": _layer_keys(c),
        "draft_vocab_size": c.vocab_size,
        "target_hidden_size": c.hidden_size,
        "block_size": c.block_size,
        "aux_hidden_state_layer_ids": list(c.target_layers),
        "mask_token_id": c.mask_token_id,
        "num_target_layers": c.num_target_layers,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }
    return write_folder(out_dir, config, cpu_tensors(drafter, dtype))


# ---- loaders -----------------------------------------------------------------------------------------------------


def zlab_target_layers(config: dict, reading: Reading, where: str) -> list[int]:
    """The target hidden states a z-lab export makes an engine capture, as HF ``hidden_states`` indices.

    ``vllm``: a top-level ``eagle_aux_hidden_state_layer_ids`` is taken verbatim as inputs of layers, else
    ``dflash_config.target_layer_ids`` plus one. ``sglang``: ``dflash_config.target_layer_ids`` as outputs of layers,
    i.e. ``hidden_states[id + 1]``. ``dflash`` (the z-lab package): ``hidden_states[id + 1]`` of the ids in
    ``dflash_config`` (its fallback, the top-level key, is checked equal when both are present).
    """
    dflash = config.get("dflash_config") or {}
    ids = dflash.get("target_layer_ids")
    if reading == "vllm" and config.get("eagle_aux_hidden_state_layer_ids") is not None:
        return [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
    if ids is None:
        raise ValueError(f"{where}: dflash_config.target_layer_ids is missing (readers would guess the layers)")
    top = config.get("target_layer_ids")
    if reading == "dflash" and top is not None and list(top) != list(ids):
        raise ValueError(f"{where}: target_layer_ids {top} and dflash_config.target_layer_ids {ids} disagree")
    return [int(i) + 1 for i in ids]


def _block_size(config: dict, where: str) -> int:
    inner, top = (config.get("dflash_config") or {}).get("block_size"), config.get("block_size")
    if inner is not None and top is not None and inner != top:
        raise ValueError(f"{where}: block_size {top} and dflash_config.block_size {inner} disagree")
    size = inner if inner is not None else top
    if size is None:
        raise ValueError(f"{where}: no block_size (readers fall back to 16 or 8)")
    return int(size)


def _config(layer: dict, target_layers: list[int], num_target_layers, block, mask, where: str) -> DFlashConfig:
    try:
        rope = layer.get("rope_parameters") or {"rope_type": "default", "rope_theta": layer["rope_theta"]}
        for key, value in (("mask_token_id", mask), ("num_target_layers", num_target_layers), ("block_size", block)):
            if value is None:
                raise KeyError(key)
        return DFlashConfig(
            hidden_size=layer["hidden_size"],
            intermediate_size=layer["intermediate_size"],
            num_hidden_layers=layer["num_hidden_layers"],
            num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer["num_key_value_heads"],
            head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
            vocab_size=layer["vocab_size"],
            target_layers=tuple(target_layers),
            num_target_layers=int(num_target_layers),
            block_size=int(block),
            mask_token_id=int(mask),
            rms_norm_eps=layer["rms_norm_eps"],
            rope_parameters=rope,
            max_position_embeddings=layer["max_position_embeddings"],
            hidden_act=layer.get("hidden_act", "silu"),
        )
    except KeyError as err:
        raise ValueError(f"{where}: config.json lacks the key {err.args[0]!r}") from err


def _consume(drafter: DFlashDrafter, tensors: dict[str, torch.Tensor], where: str) -> DFlashDrafter:
    """Load every file tensor by name; fail on one not consumed, a parameter missing or a shape that differs."""
    floats = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(floats) == 1:
        drafter.to(floats.pop())  # the file's precision
    expected = drafter.state_dict()
    unconsumed = sorted(k for k in tensors if k not in expected)
    missing = sorted(k for k in expected if k not in tensors)
    if unconsumed or missing:
        raise ValueError(f"{where}: tensors not consumed {unconsumed}, weights missing {missing}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{where}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}")
    drafter.load_state_dict(tensors, strict=True)
    return drafter


def load_zlab(path: str, reading: Reading = "vllm") -> DFlashDrafter:
    """Read a z-lab export by an engine's rules (``reading``: whose layer-id convention; every other rule is shared:
    Qwen3 layer keys, ``block_size`` from ``dflash_config`` first, ``mask_token_id`` from ``dflash_config``, weights
    without prefix and without embedding or lm_head)."""
    config, tensors = read_folder(path, "a DFlash export")
    if config.get("architectures") != ZLAB_ARCHITECTURES:
        raise ValueError(f"{path}: architectures {config.get('architectures')}, expected {ZLAB_ARCHITECTURES}")
    dflash = config.get("dflash_config") or {}
    layers = zlab_target_layers(config, reading, path)
    drafter = DFlashDrafter(
        _config(
            config,
            layers,
            config.get("num_target_layers"),
            _block_size(config, path),
            dflash.get("mask_token_id"),
            path,
        )
    )
    return _consume(drafter, tensors, path)


def load_speculators(path: str) -> DFlashDrafter:
    """Read a speculators export by its rules: the layer config under ``transformer_layer_config``, layer ids in
    ``aux_hidden_state_layer_ids`` (HF indices), a full-vocabulary draft (no vocabulary map)."""
    config, tensors = read_folder(path, "a DFlash export")
    if config.get("speculators_model_type") != "dflash":
        raise ValueError(f"{path}: speculators_model_type {config.get('speculators_model_type')!r}, expected 'dflash'")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{path}: transformer_layer_config must be a dict")
    if config.get("draft_vocab_size") not in (None, layer.get("vocab_size")):
        raise ValueError(f"{path}: a reduced draft vocabulary ({config['draft_vocab_size']}) is not a DFlash export")
    layers = config.get("aux_hidden_state_layer_ids")
    if layers is None:
        raise ValueError(f"{path}: aux_hidden_state_layer_ids is missing (speculators would guess the layers)")
    depth = config.get("num_target_layers") or _verifier_depth(config)
    drafter = DFlashDrafter(_config(layer, layers, depth, config.get("block_size"), config.get("mask_token_id"), path))
    return _consume(drafter, tensors, path)


def _verifier_depth(config: dict) -> int | None:
    """The verifier's ``num_hidden_layers`` when its folder is local (a speculators file written elsewhere does not
    carry ``num_target_layers``), else None."""
    name = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    path = Path(name) / "config.json" if name else None
    if path is None or not path.is_file():
        return None
    verifier = json.loads(path.read_text())
    return (verifier.get("text_config") or verifier).get("num_hidden_layers")
