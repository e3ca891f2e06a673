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

Speculators format (``speculators_model_type: "dflash"``, which identifies it: speculators' own ``save_pretrained``
writes ``architectures: ["DFlashDraftModel"]``, the z-lab name, and this writer ``["DFlashSpeculator"]``): the same
weights, the layer config under ``transformer_layer_config`` (read as speculators reads it, through the transformers
config class of its ``model_type``: Qwen3's defaults fill what it leaves out, ``head_dim`` 128 among them),
``block_size``, ``mask_token_id``, ``aux_hidden_state_layer_ids`` in HF ``hidden_states`` indices (z-lab ids + 1),
the full vocabulary as ``draft_vocab_size`` (no ``d2t``/``t2d``, no lm_head: speculators takes the verifier's for a
full-vocabulary draft), ``target_hidden_size`` (None or the layers' width: speculators' ``fc`` reads
``len(aux_hidden_state_layer_ids) * hidden_size``), ``sliding_window_non_causal`` and ``sample_from_anchor`` (both
False by default), and the block every speculators export writes (trainer/export/speculators.py), naming the
verifier and ``block_size - 1`` speculative tokens.
speculators' trainer declares its draft layers ``sliding_attention`` with ``sliding_window`` 2048 by default, which
its ``create_anchor_block_mask_mod`` makes causal inside the block and windowed over the context (module.py reads
both); ``sample_from_anchor: true`` (the anchor slot drafts the first token) is refused by name.

A block refiner's format (refiner.py) is the speculators format under its own ``speculators_model_type`` and
``architectures``, with its config fields beside (``save_speculators`` and ``load_speculators`` take them) and its
heads' weights in the same file (its reader may default ``sample_from_anchor`` to true, refused by name when the key
is absent), or the z-lab layout under its own ``architectures`` with its fields in ``dflash_config`` (``zlab_config``
and ``load_zlab`` take them). The z-lab and speculators DFlash writers refuse a drafter with a refiner's modules
(their readers would not load them).

The z-lab readers window each query slot: read from their source (the ``dflash`` package 0.1.0, ``dflash/model.py``;
SGLang 0.5.23, ``speculative/dflash_utils.py``), a ``sliding_attention`` layer with ``sliding_window: W`` lets slot k
of a block anchored at p see the context p + k - W + 1 .. p - 1, causal within the block unless the top-level
``is_causal`` is false. This project's window (speculators' meaning) counts from the anchor: every slot sees
p - w .. p - 1 and the whole block. No W gives that mask, so a z-lab folder whose ``layer_types`` make a layer sliding
is refused by name, and so is a drafter with sliding layers given to its writer.

Every loader maps each tensor of the file to a drafter parameter and fails on a tensor it does not consume (an
embedding or lm_head included), a missing parameter, a shape that differs, layer ids outside the target, two block
sizes that disagree, or a field it does not implement (named with its value).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from trainer.export import speculators
from trainer.export.files import cpu_tensors, read_folder, write_folder
from trainer.interface.errors import ModelFolderError
from trainer.methods.dflash.module import FULL, LAYER_TYPES, SLIDING, DFlashConfig, DFlashDrafter

ZLAB_ARCHITECTURES = ["DFlashDraftModel"]
SPECULATORS_ARCHITECTURES = ["DFlashSpeculator"]
SPECULATORS_MODEL_TYPE = "dflash"


def _refuse_refiner(drafter: DFlashDrafter, fmt: str) -> None:
    """Refuse a drafter with a block refiner's modules in a format whose readers would not load them."""
    if type(drafter).refiner_modules:
        raise ModelFolderError(
            f"the {fmt} format has no field for the heads of a {type(drafter).__name__} "
            f"({', '.join(type(drafter).refiner_modules)}): its readers would not load them",
            hint="write it in its own kind's format (draftsmith export writes that one by default)",
        )


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
        "layer_types": list(c.layer_types or [FULL] * c.num_hidden_layers),
    }
    if not c.all_full:  # as speculators' trainer writes a sliding layer config
        keys.update(sliding_window=c.sliding_window, use_sliding_window=True)
    if rope.get("rope_type", "default") != "default":
        keys["rope_scaling"] = rope
    return keys


def zlab_config(c: DFlashConfig, dtype_name: str) -> dict:
    """The z-lab ``config.json`` of a drafter config (a block refiner's format of this layout adds its own keys)."""
    return {
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


def save_zlab(drafter: DFlashDrafter, out_dir: str, dtype: torch.dtype | None = None) -> Path:
    """Write the z-lab checkpoint (``DFlashDraftModel``: SGLang, vLLM, ``DFlashDraftModel.from_pretrained``); a
    drafter with sliding-window layers is refused (its readers window each slot, not the block's anchor)."""
    _refuse_refiner(drafter, "z-lab dflash")
    refuse_sliding_zlab(drafter.config)
    dtype_name = str(dtype or drafter.fc.weight.dtype).removeprefix("torch.")
    return write_folder(out_dir, zlab_config(drafter.config, dtype_name), cpu_tensors(drafter, dtype))


def zlab_refusal(c: DFlashConfig) -> str | None:
    """Why the z-lab layout cannot hold a drafter of config ``c``: sliding-window layers (its readers window each
    query slot, the drafter's window counts from the block's anchor, module docstring); None when it can."""
    if c.all_full:
        return None
    return (
        f"layer_types {list(c.layer_types or [])} (sliding_window {c.sliding_window}, sliding_window_non_causal "
        f"{c.sliding_window_non_causal}): the z-lab format's readers (the dflash package, SGLang) window each "
        "slot of a block from its own position, this drafter's window counts from the block's anchor; no "
        "z-lab sliding_window gives that mask"
    )


def refuse_sliding_zlab(c: DFlashConfig) -> None:
    """Refuse what :func:`zlab_refusal` names."""
    reason = zlab_refusal(c)
    if reason is not None:
        raise ModelFolderError(reason, hint="write it with --format dflash-speculators")


def save_speculators(
    drafter: DFlashDrafter,
    out_dir: str,
    verifier: str,
    verifier_architectures: list[str] | None = None,
    dtype: torch.dtype | None = None,
    model_type: str = SPECULATORS_MODEL_TYPE,
    architectures: Sequence[str] = tuple(SPECULATORS_ARCHITECTURES),
    fields: Sequence[str] = (),
) -> Path:
    """Write the speculators-format checkpoint (``DFlashSpeculator``), or a block refiner's (its model type,
    architectures and config fields; its heads' weights beside the backbone's).

    Args:
        drafter: the drafter.
        out_dir: the folder to write.
        verifier: the target's directory or hub id (speculators rebuilds the embedding and lm_head from it).
        verifier_architectures: the target config's ``architectures``.
        dtype: the weights' dtype in the file (default: the drafter's).
        model_type: ``speculators_model_type`` and the algorithm: ``dflash`` (a drafter with a refiner's modules
            is refused), or a refiner's.
        architectures: the ``architectures`` written.
        fields: the drafter config's fields written beside the DFlash keys (a refiner's).
    """
    c = drafter.config
    if model_type == SPECULATORS_MODEL_TYPE:
        _refuse_refiner(drafter, "dflash-speculators")
    fields = {
        "transformer_layer_config": _layer_keys(c),
        "draft_vocab_size": c.vocab_size,
        "target_hidden_size": c.hidden_size,
        "block_size": c.block_size,
        "aux_hidden_state_layer_ids": list(c.target_layers),
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": bool(c.sliding_window_non_causal),
        "sample_from_anchor": False,
        **{key: getattr(c, key) for key in fields},
        "num_target_layers": c.num_target_layers,
    }
    config = speculators.speculators_config(
        model_type, architectures, verifier, c.block_size - 1, verifier_architectures, fields,
        dtype or drafter.fc.weight.dtype,
    )  # fmt: skip
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
        raise ModelFolderError(f"{where}: dflash_config.target_layer_ids is missing (readers would guess the layers)")
    top = config.get("target_layer_ids")
    if reading == "dflash" and top is not None and list(top) != list(ids):
        raise ModelFolderError(f"{where}: target_layer_ids {top} and dflash_config.target_layer_ids {ids} disagree")
    return [int(i) + 1 for i in ids]


def _block_size(config: dict, where: str) -> int:
    inner, top = (config.get("dflash_config") or {}).get("block_size"), config.get("block_size")
    if inner is not None and top is not None and inner != top:
        raise ModelFolderError(f"{where}: block_size {top} and dflash_config.block_size {inner} disagree")
    size = inner if inner is not None else top
    if size is None:
        raise ModelFolderError(f"{where}: no block_size (readers fall back to 16 or 8)")
    return int(size)


# keys of a z-lab config.json that are not the draft layers' (speculators' converter leaves the same ones out)
ZLAB_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers")


def layer_config(layer: dict, where: str, key: str) -> dict:
    """The draft layers' config as speculators, SGLang, vLLM and the z-lab package read it: built by the transformers
    config class of its ``model_type`` (Qwen3 when it has none), whose defaults fill what the file leaves out
    (``head_dim``, ``layer_types`` from ``use_sliding_window`` and ``max_window_layers``, ``sliding_window`` None
    unless ``use_sliding_window``), and returned as a dict. ``key`` names it in errors."""
    from transformers import CONFIG_MAPPING

    model_type = layer.get("model_type") or "qwen3"
    if model_type not in CONFIG_MAPPING:
        raise ModelFolderError(f"{where}: {key}.model_type {model_type!r} is not a transformers config type")
    try:
        config = CONFIG_MAPPING[model_type](**{k: v for k, v in layer.items() if k != "model_type"})
    except Exception as err:  # transformers' own validation (a strict dataclass error is no ValueError)
        raise ModelFolderError(f"{where}: {key} is not a {model_type} config ({' '.join(str(err).split())})") from err
    out = config.to_dict()
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get(SLIDING), dict):  # per layer type: speculators takes this one
        out["rope_parameters"] = rope[SLIDING]
    return out


def _refuse(where: str, key: str, value, why: str) -> ModelFolderError:
    return ModelFolderError(f"{where}: {key} {json.dumps(value)}: {why}")


def _attention(layer: dict, non_causal, where: str, key: str) -> dict:
    """``layer_types``, ``sliding_window`` and ``sliding_window_non_causal`` of the drafter config (module.py's
    reading of them, speculators' ``create_anchor_block_mask_mod``); all layers full: the defaults."""
    n = layer["num_hidden_layers"]
    types = list(layer.get("layer_types") or [FULL] * n)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != n:
        why = (
            f"{unknown} is no layer type a DFlash drafter has ({', '.join(LAYER_TYPES)})"
            if unknown
            else (f"{len(types)} entries for {n} layers")
        )
        raise _refuse(where, f"{key}.layer_types", types, why)
    window = layer.get("sliding_window")
    if SLIDING not in types or window is None:  # a sliding layer without a window attends as a full one
        return {}
    if not isinstance(non_causal, bool):
        raise _refuse(where, "sliding_window_non_causal", non_causal, "must be true or false")
    return {"layer_types": tuple(types), "sliding_window": int(window), "sliding_window_non_causal": non_causal}


def _config(
    layer: dict,
    target_layers: list[int],
    num_target_layers,
    block,
    mask,
    where: str,
    attention: dict | None = None,
    config_class: type[DFlashConfig] = DFlashConfig,
) -> DFlashConfig:
    """The drafter config (a ``config_class``) of a normalised layer config (:func:`layer_config`) and the format's
    own keys (``attention``: the layers' attention and a refiner's fields)."""
    if layer.get("attention_bias"):
        raise _refuse(where, "attention_bias", True, "DFlash's attention projections have no bias")
    try:
        for key, value in (("mask_token_id", mask), ("num_target_layers", num_target_layers), ("block_size", block)):
            if value is None:
                raise KeyError(key)
        return config_class(
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
            # transformers keeps transformers 4's ``type`` beside the ``rope_type`` it copies it to
            rope_parameters={k: v for k, v in layer["rope_parameters"].items() if k != "type"},
            max_position_embeddings=layer["max_position_embeddings"],
            hidden_act=layer.get("hidden_act", "silu"),
            **(attention or {}),
        )
    except KeyError as err:
        raise ModelFolderError(f"{where}: config.json lacks the key {err.args[0]!r}") from err
    except ValueError as err:
        raise ModelFolderError(f"{where}: {err}") from err


def _consume(drafter: DFlashDrafter, tensors: dict[str, torch.Tensor], where: str) -> DFlashDrafter:
    """Load every file tensor by name; fail on one not consumed, a parameter missing or a shape that differs."""
    floats = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(floats) == 1:
        drafter.to(floats.pop())  # the file's precision
    expected = drafter.state_dict()
    unconsumed = sorted(k for k in tensors if k not in expected)
    missing = sorted(k for k in expected if k not in tensors)
    if unconsumed or missing:
        raise ModelFolderError(f"{where}: tensors not consumed {unconsumed}, weights missing {missing}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ModelFolderError(
                f"{where}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )
    drafter.load_state_dict(tensors, strict=True)
    return drafter


def load_zlab(
    path: str,
    reading: Reading = "vllm",
    architectures: Sequence[str] = tuple(ZLAB_ARCHITECTURES),
    drafter_class: type[DFlashDrafter] = DFlashDrafter,
    config_class: type[DFlashConfig] = DFlashConfig,
    fields: dict[str, Any] | None = None,
) -> DFlashDrafter:
    """Read a z-lab export by an engine's rules (``reading``: whose layer-id convention; every other rule is shared:
    the layer config as its transformers config class reads it, ``block_size`` from ``dflash_config`` first,
    ``mask_token_id`` from ``dflash_config``, weights without prefix and without embedding or lm_head). A folder with
    ``speculators_model_type`` is the speculators format's, and one whose layers are sliding is refused.

    Args:
        path: the folder.
        reading: the engine whose layer-id convention applies.
        architectures: the ``architectures`` expected (a block refiner's format of this layout names its own).
        drafter_class: the drafter to build (a refiner's, whose heads' weights the file holds).
        config_class: its config.
        fields: a refiner's config fields read from ``dflash_config``, with the value of each the file leaves out.
    """
    config, tensors = read_folder(path, "a DFlash export")
    if config.get("architectures") != list(architectures):
        raise ModelFolderError(f"{path}: architectures {config.get('architectures')}, expected {list(architectures)}")
    if speculators.read_block(config).model_type is not None:
        raise ModelFolderError(
            f"{path}: speculators_model_type {config['speculators_model_type']!r}: a speculators export, not the "
            "z-lab format (read it with load_speculators)"
        )
    dflash = config.get("dflash_config") or {}
    layers = zlab_target_layers(config, reading, path)
    layer = layer_config({k: v for k, v in config.items() if k not in ZLAB_KEYS}, path, "config.json")
    if _attention(layer, False, path, "config.json"):
        raise _refuse(
            path, "layer_types", layer["layer_types"],
            f"sliding_window {layer['sliding_window']}: the z-lab readers window each slot of a block from its own "
            "position (causal within the block unless is_causal is false); draftsmith's DFlash window counts from "
            "the block's anchor (the speculators format's meaning) and cannot run this mask",
        )  # fmt: skip
    own = {key: dflash.get(key, default) for key, default in (fields or {}).items()}
    drafter_config = _config(
        layer, layers, config.get("num_target_layers"), _block_size(config, path), dflash.get("mask_token_id"), path,
        own, config_class,
    )  # fmt: skip
    return _consume(drafter_class(drafter_config), tensors, path)


def load_speculators(
    path: str,
    model_type: str = SPECULATORS_MODEL_TYPE,
    drafter_class: type[DFlashDrafter] = DFlashDrafter,
    config_class: type[DFlashConfig] = DFlashConfig,
    fields: dict[str, Any] | None = None,
    sample_from_anchor: bool = False,
) -> DFlashDrafter:
    """Read a speculators export by its rules (speculators' ``DFlashSpeculatorConfig`` and ``DFlashDraftModel``, or
    a block refiner's, a subclass of them): the layer config under ``transformer_layer_config``, layer ids in
    ``aux_hidden_state_layer_ids`` (HF indices), a full-vocabulary draft (no vocabulary map), ``target_hidden_size``
    None or the layers' width, the layers' attention (``layer_types``, ``sliding_window``,
    ``sliding_window_non_causal``), ``sample_from_anchor`` false, and a refiner's config fields.

    Args:
        path: the folder.
        model_type: the ``speculators_model_type`` expected.
        drafter_class: the drafter to build (a refiner's, whose heads' weights the file holds).
        config_class: its config.
        fields: a refiner's config fields read from the file, with the value of each the file leaves out (its
            reader's default).
        sample_from_anchor: the reader's default of ``sample_from_anchor`` (true is refused, by name when absent).
    """
    config, tensors = read_folder(path, f"a {model_type} export")
    speculators.check_model_type(config, model_type, path)
    block_header = speculators.read_block(config)
    raw = config.get("transformer_layer_config")
    if not isinstance(raw, dict):
        raise ModelFolderError(f"{path}: transformer_layer_config must be a dict")
    layer = layer_config(raw, path, "transformer_layer_config")
    if config.get("draft_vocab_size") not in (None, layer.get("vocab_size")):
        raise _refuse(
            path, "draft_vocab_size", config["draft_vocab_size"],
            f"a reduced draft vocabulary (the target's has {layer.get('vocab_size')}) is not a DFlash export",
        )  # fmt: skip
    if config.get("target_hidden_size") not in (None, layer["hidden_size"]):
        raise _refuse(
            path, "target_hidden_size", config["target_hidden_size"],
            f"speculators' fc reads hidden states of the layers' width, {layer['hidden_size']}",
        )  # fmt: skip
    from_anchor = config.get("sample_from_anchor", sample_from_anchor)  # absent: the reader's default
    if from_anchor is not False:
        absent = f"(absent: speculators {model_type} default) " if "sample_from_anchor" not in config else ""
        raise _refuse(
            path, "sample_from_anchor", from_anchor,
            f"{absent}the anchor slot "
            "drafting the first token is not implemented by draftsmith's DFlash proposer (slots 1..b-1 draft)",
        )  # fmt: skip
    layers = config.get("aux_hidden_state_layer_ids")
    if layers is None:
        raise ModelFolderError(f"{path}: aux_hidden_state_layer_ids is missing (speculators would guess the layers)")
    block = config.get("block_size", 8)  # speculators' default
    drafts = block_header.speculative_tokens
    if any(not isinstance(d, int) or not 1 <= d <= int(block) - 1 for d in drafts):
        raise _refuse(
            path, "speculators_config.proposal_methods[].speculative_tokens", drafts,
            f"a block of {block} drafts 1..{int(block) - 1} tokens",
        )  # fmt: skip
    depth = config.get("num_target_layers") or _verifier_depth(block_header.verifier)
    if depth is None:
        raise ModelFolderError(
            f"{path}: config.json has no num_target_layers, and its verifier {block_header.verifier!r} is no local "
            "folder with a "
            "config.json to count the target's layers in",
            hint="run from the folder the verifier path is relative to, or add num_target_layers to config.json",
        )
    attention = _attention(layer, config.get("sliding_window_non_causal", False), path, "transformer_layer_config")
    attention.update({key: config.get(key, default) for key, default in (fields or {}).items()})
    drafter_config = _config(layer, layers, depth, block, config.get("mask_token_id"), path, attention, config_class)
    drafter = drafter_class(drafter_config)
    return _consume(drafter, tensors, path)


def _verifier_depth(verifier: str | None) -> int | None:
    """The ``num_hidden_layers`` of the verifier a speculators file names, when its folder is local (a speculators
    file written elsewhere does not carry ``num_target_layers``), else None."""
    path = Path(verifier) / "config.json" if verifier else None
    if path is None or not path.is_file():
        return None
    config = json.loads(path.read_text())
    return (config.get("text_config") or config).get("num_hidden_layers")
