"""EAGLE-3 exports: the native format (SGLang, vLLM) and the speculators format (vLLM), with loaders.

Native: ``config.json`` with ``architectures: ["LlamaForCausalLMEagle3"]`` and Llama keys, weights without prefix
(``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``). Target layers are written twice: vLLM reads the
top-level ``eagle_aux_hidden_state_layer_ids`` as inputs of layers (HF ``hidden_states[i]``, our convention); SGLang
reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` as outputs of layers and captures ``id + 1``, so it gets
``i - 1``.

Speculators: the block every speculators export writes (trainer/export/speculators.py: ``architectures:
["Eagle3Speculator"]``, ``speculators_model_type: "eagle3"``, ``speculators_config`` naming the verifier), the layer
config under ``transformer_layer_config``, ``norm_before_residual: false`` written explicitly (vLLM assumes true when
missing), weights under ``layers.0.*`` instead of ``midlayer.*``; vLLM reads ``eagle_aux_hidden_state_layer_ids`` as
inputs.

The speculators format also carries the target's input embedding as ``embed_tokens.weight`` (speculators 0.9 reads
it from the file and keeps uninitialised memory when it is missing, so the drafter would draft from garbage
embeddings), the TTT steps as ``speculative_tokens``, and the norm flags written explicitly; the native format carries
no embedding (SGLang and vLLM use the target's). tests/clients/ runs the speculators library itself on the export.

Norm flags (module.py, EAGLE-3.1): the speculators format writes all four as trained (``norm_before_residual``,
``norm_before_fc`` with ``input_norm.weight``, ``fc_norm`` with ``fc_norm.{j}.weight``, ``norm_output``), under
speculators 0.9's names. The native format writes ``norm_before_residual`` and ``norm_before_fc`` (with
``input_norm.weight``), the two flags the native ``LlamaForCausalLMEagle3`` loaders read from config.json; it refuses
a drafter trained with ``fc_norm`` or ``norm_output``, which those loaders have no key for (they would draft with
another network without a word): such a drafter is exported as ``eagle3-speculators``.

Sliding window (module.py ``Eagle3Config.window``): the speculators format writes ``sliding_window`` and ``layer_types``
(``sliding_attention`` for every decoder layer) into ``transformer_layer_config``, as HF Llama/Qwen3 configs spell them
and as speculators 0.9's ``Eagle3DraftModel`` reads them; the native format has no such key and refuses a windowed
drafter.

Rotary settings: both formats write the drafter's ``rope_parameters`` (the target's) in the layer keys, with
``rope_theta`` and, for a scaled rotary embedding, ``rope_scaling`` beside them; the loaders read ``rope_parameters``,
or ``rope_theta`` and ``rope_scaling`` from a file written without it (:func:`legacy_rope`).

The loaders follow each engine's naming rules: they map every tensor of the file to a drafter parameter, and fail
when a tensor is not consumed, a parameter is missing, a shape differs, or the layer ids disagree between the two
conventions.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from trainer.export import speculators
from trainer.export.files import cpu_tensors, read_folder, write_folder
from trainer.interface.errors import ModelFolderError, UsageError
from trainer.methods.eagle3.module import NORM_FLAGS, Eagle3Config, Eagle3Drafter, flag_weight_mismatch

NATIVE_FLAGS = ("norm_before_residual", "norm_before_fc")  # what the native format's loaders read
MODEL_TYPE = "eagle3"
"""The speculators format's ``speculators_model_type``."""
ARCHITECTURES = ["Eagle3Speculator"]


def _layer_keys(config: Eagle3Config, layers: int = 1) -> dict:
    """Llama keys of the drafter's ``layers`` decoder layers (both formats)."""
    llama = config.llama_config().to_dict()
    keep = (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
        "max_position_embeddings", "hidden_act", "vocab_size", "rope_parameters", "attention_bias", "mlp_bias",
    )  # fmt: skip
    out = {k: llama[k] for k in keep}
    out["model_type"] = "llama"
    out["num_hidden_layers"] = layers
    if config.window is not None:  # HF Llama/Qwen3 spelling, read by speculators 0.9 (see the module docstring)
        out["sliding_window"] = config.window
        out["layer_types"] = ["sliding_attention"] * layers
    out["tie_word_embeddings"] = False
    rope = dict(config.rope_parameters)
    out["rope_theta"] = rope.get("rope_theta", 10000.0)  # older engine versions read these two keys
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = rope
    return out


def native_refusal(c: Eagle3Config) -> str | None:
    """Why the native format cannot hold a drafter of config ``c`` (a sliding window, a norm flag its loaders cannot
    read: ``fc_norm``, ``norm_output``), None when it can."""
    if c.window is not None:
        return (
            f"the native eagle3 format cannot express a sliding window (window: {c.window}): its loaders read no "
            "window key and would draft with full attention"
        )
    for flag in NORM_FLAGS:
        if flag not in NATIVE_FLAGS and getattr(c, flag):
            return (
                f"the native eagle3 format cannot express {flag}: true (its loaders have no such key and would draft "
                "with another network)"
            )
    return None


def save_native(drafter: Eagle3Drafter, out_dir: str, dtype: torch.dtype | None = None) -> Path:
    """Write the native EAGLE-3 checkpoint (SGLang and vLLM ``LlamaForCausalLMEagle3``); a drafter the format cannot
    hold (:func:`native_refusal`) is refused naming what it lacks."""
    c = drafter.config
    reason = native_refusal(c)
    if reason is not None:
        raise UsageError(reason, hint="export it with --format eagle3-speculators")
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_layer_keys(c),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.aux_layers]},
        **{flag: getattr(c, flag) for flag in NATIVE_FLAGS},
        "torch_dtype": str(dtype or drafter.fc.weight.dtype).removeprefix("torch."),
    }
    tensors = cpu_tensors(drafter)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    return write_folder(out_dir, config, tensors)


def speculators_config(
    drafter: Eagle3Drafter,
    model_type: str,
    architectures: list[str],
    verifier: str,
    speculative_tokens: int,
    verifier_architectures: list[str] | None,
    dtype: torch.dtype | None,
) -> dict:
    """The config.json of the speculators format for ``model_type`` (``eagle3``, or a method extending EAGLE-3 with
    its own keys added by the caller, P-EAGLE's ``peagle``), whose speculator class is ``architectures``: the block
    of every speculators export (trainer/export/speculators.py) around the EAGLE-3 drafter's keys."""
    c = drafter.config
    if c.hidden_size != c.target_hidden_size:
        raise ValueError(
            f"the speculators format needs the drafter's width ({c.hidden_size}) to be the target's "
            f"({c.target_hidden_size}); use the native eagle3 format"
        )
    if len(set(c.aux_layers)) != len(c.aux_layers):
        raise ValueError(f"the speculators format refuses repeated target layer ids: {list(c.aux_layers)}")
    fields = {
        "transformer_layer_config": _layer_keys(c, drafter.num_decoder_layers),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
        # as trained, all explicit: vLLM assumes norm_before_residual true when it is missing
        **c.flags(),
    }
    return speculators.speculators_config(
        model_type, architectures, verifier, speculative_tokens, verifier_architectures, fields,
        dtype or drafter.fc.weight.dtype,
    )  # fmt: skip


def save_speculators(
    drafter: Eagle3Drafter,
    out_dir: str,
    verifier: str,
    embedding: torch.Tensor,
    speculative_tokens: int,
    verifier_architectures: list[str] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the speculators-format checkpoint (vLLM ``Eagle3Speculator``, and the speculators library).

    Args:
        drafter: the drafter.
        out_dir: the folder to write.
        verifier: the target's directory or hub id (speculators reads its config and weights on every load).
        embedding: the target's input embedding [V, H], written as ``embed_tokens.weight``: speculators 0.9 reads
            the drafter's embedding from the file and, when it is missing, keeps uninitialised memory (no warning).
        speculative_tokens: drafts per round the drafter was trained for (its TTT steps); vLLM's default
            ``num_speculative_tokens``.
        verifier_architectures: the target config's ``architectures``.
        dtype: the weights' dtype in the file (default: the drafter's).
    """
    c = drafter.config
    if tuple(embedding.shape) != (c.vocab_size, c.hidden_size):
        raise ValueError(f"the target embedding is {tuple(embedding.shape)}, expected {(c.vocab_size, c.hidden_size)}")
    config = speculators_config(
        drafter, MODEL_TYPE, ARCHITECTURES, verifier, speculative_tokens, verifier_architectures, dtype
    )
    embedding = embedding.detach().cpu().to(drafter.fc.weight.dtype).contiguous()
    return write_folder(out_dir, config, speculators_tensors(drafter, dtype, {"embed_tokens.weight": embedding}))


def speculators_tensors(
    drafter: nn.Module, dtype: torch.dtype | None, extra: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the speculators names (``midlayer.*`` -> ``layers.0.*``, a P-EAGLE drafter's
    ``deep_layers.{i}.*`` -> ``layers.{i + 1}.*``) with ``extra`` added, in ``dtype`` (None: as they are)."""
    tensors = {speculators_name(k): v for k, v in cpu_tensors(drafter).items()} | (extra or {})
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    return tensors


def speculators_name(name: str) -> str:
    """A drafter tensor's name in the speculators format (``layers.{j}.*`` for decoder layer j)."""
    if name.startswith("midlayer."):
        return "layers.0." + name.removeprefix("midlayer.")
    if name.startswith("deep_layers."):
        index, rest = name.removeprefix("deep_layers.").split(".", 1)
        return f"layers.{int(index) + 1}.{rest}"
    return name


def module_name(name: str) -> str:
    """The inverse of :func:`speculators_name` (``""`` for our own layer names, which vLLM would not load)."""
    if name.startswith(("midlayer.", "deep_layers.")):
        return ""
    if name.startswith("layers."):
        index, rest = name.removeprefix("layers.").split(".", 1)
        if not index.isdigit():
            return name
        return f"midlayer.{rest}" if int(index) == 0 else f"deep_layers.{int(index) - 1}.{rest}"
    return name


# ---- loaders -----------------------------------------------------------------------------------------------------


def _flags(config: dict, names: tuple[str, ...], where: str) -> dict[str, bool]:
    """The norm flags of a config.json (absent: false), refused unless booleans."""
    out = {}
    for name in names:
        value = config.get(name, False)
        if not isinstance(value, bool):
            raise ModelFolderError(f"{where}: config.json {name} must be true or false, got {value!r}")
        out[name] = value
    return out


def decoder_layers(layer: dict, where: str) -> int:
    """The decoder layers of a speculators export: ``transformer_layer_config.num_hidden_layers`` (1 when absent, as
    in exports written before several were trained), refused unless an integer >= 1."""
    layers = layer.get("num_hidden_layers", 1)
    if not isinstance(layers, int) or layers < 1:
        raise ModelFolderError(f"{where}: transformer_layer_config.num_hidden_layers must be >= 1, got {layers!r}")
    return layers


def layer_window(layer: dict, where: str) -> int | None:
    """The sliding window of a layer config (``layer_types`` all ``sliding_attention`` with ``sliding_window``), or
    None (no ``layer_types``, or all ``full_attention``); a mix of both, or a bad window, is refused."""
    types = layer.get("layer_types")
    if types is None or all(t == "full_attention" for t in types):
        return None
    window = layer.get("sliding_window")
    if any(t != "sliding_attention" for t in types):
        raise ModelFolderError(
            f"{where}: layer_types {types}: draftsmith's drafters have one window for every layer (all "
            "sliding_attention or all full_attention)"
        )
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelFolderError(f"{where}: layer_types asks for sliding_attention but sliding_window is {window!r}")
    return window


def legacy_rope(layer: dict) -> dict:
    """The ``rope_parameters`` of a layer config that spells them as transformers 4 did: ``rope_theta`` and, for a
    scaled rotary embedding, ``rope_scaling`` (its ``type`` the older name of ``rope_type``), as the engines read
    them; a missing ``rope_theta`` raises KeyError."""
    scaling = dict(layer.get("rope_scaling") or {})
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    return {"rope_type": "default", "rope_theta": layer["rope_theta"], **scaling}


def _config(layer: dict, top: dict, aux_layers: list[int], where: str, flags: dict[str, bool]) -> Eagle3Config:
    if flags.get("norm_before_fc") and flags.get("fc_norm"):
        raise ModelFolderError(f"{where}: config.json sets both norm_before_fc and fc_norm (mutually exclusive)")
    window = layer_window(layer, where)
    try:
        rope = layer.get("rope_parameters") or legacy_rope(layer)
        return Eagle3Config(
            hidden_size=layer["hidden_size"],
            intermediate_size=layer["intermediate_size"],
            num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer["num_key_value_heads"],
            head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
            vocab_size=layer["vocab_size"],
            draft_vocab_size=top["draft_vocab_size"],
            target_hidden_size=top.get("target_hidden_size") or layer["hidden_size"],
            aux_layers=tuple(aux_layers),
            rms_norm_eps=layer["rms_norm_eps"],
            rope_parameters=rope,
            max_position_embeddings=layer["max_position_embeddings"],
            window=window,
            **flags,
        )
    except KeyError as err:
        raise ValueError(f"{where}: config.json lacks the key {err.args[0]!r}") from err


def consume_tensors(drafter: Eagle3Drafter, tensors: dict[str, torch.Tensor], rename, where: str) -> Eagle3Drafter:
    """Load every file tensor through ``rename`` (file name -> module name, or None for a checked extra)."""
    floats = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(floats) == 1:
        drafter.to(floats.pop())  # the file's precision
    renamed = [rename(name) for name in tensors]
    problem = flag_weight_mismatch(drafter.config, [n for n in renamed if n])
    if problem:
        raise ModelFolderError(f"{where}: the weights disagree with config.json: {problem}")
    expected = drafter.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    unconsumed = []
    for name, tensor in tensors.items():
        target = rename(name)
        if target not in expected:
            unconsumed.append(name)
            continue
        if tuple(tensor.shape) != tuple(expected[target].shape):
            raise ValueError(
                f"{where}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[target].shape)}"
            )
        loaded[target] = tensor
    missing = sorted(set(expected) - set(loaded))
    if unconsumed or missing:
        raise ValueError(f"{where}: tensors not consumed {sorted(unconsumed)}, weights missing {missing}")
    drafter.load_state_dict(loaded, strict=True)
    t2d = torch.zeros_like(drafter.t2d)
    t2d[drafter.draft_ids()] = True
    if not torch.equal(t2d, drafter.t2d):
        raise ValueError(f"{where}: t2d does not match d2t (the engines rebuild the map from d2t alone)")
    return drafter


def load_native(path: str) -> Eagle3Drafter:
    """Read a native export by the engines' rules: names without prefix, ``midlayer.*`` the one layer; layer ids from
    vLLM's top-level key (inputs of layers), checked against SGLang's ``eagle_config`` (outputs of layers)."""
    config, tensors = read_folder(path, "an EAGLE-3 export")
    if config.get("architectures") != ["LlamaForCausalLMEagle3"]:
        raise ValueError(f"{path}: architectures {config.get('architectures')}, expected ['LlamaForCausalLMEagle3']")
    vllm_ids = config.get("eagle_aux_hidden_state_layer_ids")
    sglang_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if vllm_ids is None or sglang_ids is None:
        raise ValueError(f"{path}: the layer ids must be written for both vLLM and SGLang")
    if [i + 1 for i in sglang_ids] != list(vllm_ids):
        raise ValueError(f"{path}: SGLang layer ids {sglang_ids} (outputs) disagree with vLLM's {vllm_ids} (inputs)")
    if config.get("num_hidden_layers") != 1:
        raise ValueError(f"{path}: num_hidden_layers must be 1, got {config.get('num_hidden_layers')}")
    for flag in NORM_FLAGS:
        if flag not in NATIVE_FLAGS and config.get(flag):
            raise ModelFolderError(f"{path}: {flag} is not a key of the native format (the engines would ignore it)")
    if layer_window(config, path) is not None:
        raise ModelFolderError(
            f"{path}: the native eagle3 format has no sliding window (layer_types {config['layer_types']})"
        )
    drafter = Eagle3Drafter(_config(config, config, vllm_ids, path, _flags(config, NATIVE_FLAGS, path)))
    return consume_tensors(drafter, tensors, lambda name: name, path)


def read_speculators(path: str, model_type: str, what: str) -> tuple[dict, dict[str, torch.Tensor], Eagle3Config, int]:
    """A speculators export of ``model_type`` (EAGLE-3's, or a method's extending it) read by vLLM's rules, as far as
    the EAGLE-3 drafter goes.

    Args:
        path: the folder.
        model_type: the ``speculators_model_type`` expected.
        what: the export named in a missing file's error (``an EAGLE-3 export``).

    Returns:
        The ``config.json``, the tensors, the EAGLE-3 shape it describes (the norm flags as written, absent ones false)
        and its decoder layers (``transformer_layer_config.num_hidden_layers``; 1 when absent).
    """
    config, tensors = read_folder(path, what)
    speculators.check_model_type(config, model_type, path)
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ModelFolderError(f"{path}: transformer_layer_config must be a dict")
    layers = decoder_layers(layer, path)
    flags = _flags(config, NORM_FLAGS, path)
    return config, tensors, _config(layer, config, config["eagle_aux_hidden_state_layer_ids"], path, flags), layers


def load_speculators(path: str) -> Eagle3Drafter:
    """Read a speculators export by vLLM's rules: ``layers.0.*`` is the layer, the rest without prefix."""
    config, tensors, shape, layers = read_speculators(path, MODEL_TYPE, "an EAGLE-3 export")
    if not isinstance(config.get("norm_before_residual"), bool):
        raise ModelFolderError(f"{path}: norm_before_residual must be written (vLLM assumes true when it is missing)")
    if layers != 1:
        raise ModelFolderError(
            f"{path}: transformer_layer_config.num_hidden_layers is {layers!r}: draftsmith's EAGLE-3 drafter has one "
            "decoder layer (a P-EAGLE drafter may have several)"
        )
    drafter = Eagle3Drafter(shape)

    embedding = tensors.pop("embed_tokens.weight", None)
    c = drafter.config
    if embedding is None or tuple(embedding.shape) != (c.vocab_size, c.hidden_size):
        shape = None if embedding is None else tuple(embedding.shape)
        raise ValueError(
            f"{path}: embed_tokens.weight is {shape}, expected the target's embedding {(c.vocab_size, c.hidden_size)} "
            "(speculators keeps uninitialised memory for a missing one)"
        )

    return consume_tensors(drafter, tensors, module_name, path)
