"""Medusa exports: vLLM's ``MedusaModel`` checkpoint and the original Medusa / TGI layout, each with a loader that
follows that engine's rules.

vLLM (``medusa``): ``config.json`` {``architectures: ["MedusaModel"]``, ``model_type: "medusa"``, ``hidden_size``,
``vocab_size`` (both explicit: vLLM's defaults, 4096 and 32001, are wrong for any modern model), ``num_heads``,
``num_hidden_layers`` (blocks per head), ``medusa_fc_bias``}; weights ``blocks.{h}.layers.{l}.weight`` (+ ``.bias``)
and ``lm_heads.{h}.weight`` in ``model.safetensors``. vLLM renames every config key containing "num" and "heads" to
``num_heads`` and every key containing "num" and "layers" to ``num_hidden_layers``, so no other such key is written
(no target ``num_attention_heads`` or ``num_hidden_layers``); it builds as many heads as ``num_speculative_tokens``
asks (pass the head count) and drops unknown tensor names silently, so the loader insists that every tensor is used.

Original Medusa / TGI (``medusa-tgi``): ``config.json`` {``medusa_num_heads``, ``medusa_num_layers``,
``base_model_name_or_path``} and NO ``architectures`` key (TGI silently disables speculation when it finds one);
weights in ``medusa_lm_head.safetensors`` as ``{h}.{l}.linear.weight``/``.bias`` (TGI's blocks always have a bias:
heads trained without one are written with zero biases, the same function) and ``{h}.{num_layers}.weight``. TGI
loads each block of a head from its own keys; the original Medusa code repeats one block module inside a head, so it
would read only the last block of a multi-block head correctly.

Medusa-2 drafters carry their trained target: it is written beside the heads as an HF checkpoint in ``target/``
(serve the heads with that model, not the original).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from trainer.export.files import WEIGHTS, cpu_tensors, read_folder, write_folder
from trainer.interface.errors import ModelFolderError
from trainer.methods.medusa.module import MedusaConfig, MedusaDrafter

VLLM_WEIGHTS = WEIGHTS
TGI_WEIGHTS = "medusa_lm_head.safetensors"
TARGET_FOLDER = "target"


def _write_target(drafter: MedusaDrafter, folder: Path, tokenizer_from: str | None) -> None:
    if drafter.model is not None:
        from trainer.export.hf import save_hf

        save_hf(drafter.model, str(folder / TARGET_FOLDER), tokenizer_from)


def save_vllm(drafter: MedusaDrafter, out_dir: str, tokenizer_from: str | None = None) -> Path:
    """Write vLLM's Medusa checkpoint (and the trained target of a Medusa-2 drafter in ``target/``)."""
    c = drafter.config
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "num_heads": c.num_heads,
        "num_hidden_layers": c.num_layers,
        "medusa_fc_bias": c.bias,
        "torch_dtype": str(drafter.heads.lm_heads[0].weight.dtype).removeprefix("torch."),
    }
    write_folder(folder, config, cpu_tensors(drafter.heads), VLLM_WEIGHTS)
    _write_target(drafter, folder, tokenizer_from)
    return folder


def save_tgi(drafter: MedusaDrafter, out_dir: str, base_model: str, tokenizer_from: str | None = None) -> Path:
    """Write the original Medusa / TGI layout (and the trained target of a Medusa-2 drafter in ``target/``)."""
    c = drafter.config
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for h, (block, head) in enumerate(zip(drafter.heads.blocks, drafter.heads.lm_heads)):
        for i, layer in enumerate(block.layers):
            tensors[f"{h}.{i}.linear.weight"] = layer.weight.detach().cpu().contiguous()
            bias = layer.bias if layer.bias is not None else torch.zeros_like(layer.weight[:, 0])
            tensors[f"{h}.{i}.linear.bias"] = bias.detach().cpu().contiguous()
        tensors[f"{h}.{c.num_layers}.weight"] = head.weight.detach().cpu().contiguous()
    config = {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers, "base_model_name_or_path": base_model}
    write_folder(folder, config, tensors, TGI_WEIGHTS)
    _write_target(drafter, folder, tokenizer_from)
    return folder


# ---- loaders -----------------------------------------------------------------------------------------------------


def _target(folder: Path) -> object | None:
    path = folder / TARGET_FOLDER
    return AutoModelForCausalLM.from_pretrained(path) if (path / "config.json").is_file() else None


def _drafter(config: MedusaConfig, folder: Path, tensors: dict[str, torch.Tensor], where: str) -> MedusaDrafter:
    """A drafter whose heads take exactly ``tensors`` (module names): every tensor used, every weight given."""
    model = _target(folder)
    config.with_target = model is not None
    drafter = MedusaDrafter(config, model)
    expected = drafter.heads.state_dict()
    unused = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if unused or missing:
        raise ModelFolderError(f"{where}: tensors not consumed {unused}, weights missing {missing}")
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            want = tuple(expected[name].shape)
            raise ModelFolderError(f"{where}: {name} has shape {tuple(tensor.shape)}, expected {want}")
    drafter.heads.to(next(iter(tensors.values())).dtype)
    drafter.heads.load_state_dict(tensors, strict=True)
    return drafter


def vllm_config_keys(config: dict) -> dict:
    """The config as vLLM reads it: keys containing "num" and "heads" become ``num_heads``, "num" and "layers"
    ``num_hidden_layers``; two keys renamed to one name is an error (vLLM would keep whichever came last)."""
    out: dict = {}
    origin: dict = {}
    for key, value in config.items():
        name = key
        if "num" in key and "heads" in key:
            name = "num_heads"
        elif "num" in key and "layers" in key:
            name = "num_hidden_layers"
        if name in origin:
            raise ModelFolderError(f"config keys {origin[name]!r} and {key!r} both become {name!r} in vLLM")
        origin[name] = key
        out[name] = value
    return out


def load_vllm(path: str, num_speculative_tokens: int | None = None) -> MedusaDrafter:
    """Read a vLLM Medusa export by vLLM's rules (renamed config keys, ``num_speculative_tokens`` heads built, names
    matched as they are); ``num_speculative_tokens`` defaults to the config's ``num_heads``."""
    folder = Path(path)
    raw, tensors = read_folder(folder, "a Medusa export", VLLM_WEIGHTS)
    config = vllm_config_keys(raw)
    if config.get("architectures") != ["MedusaModel"]:
        raise ModelFolderError(f"{path}: architectures {config.get('architectures')}, expected ['MedusaModel']")
    for key in ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers"):
        if key not in config:
            raise ModelFolderError(f"{path}: config.json lacks {key!r} (vLLM would use a default that fits no target)")
    heads = num_speculative_tokens or int(config["num_heads"])
    medusa = MedusaConfig(
        hidden_size=int(config["hidden_size"]), vocab_size=int(config["vocab_size"]), num_heads=heads,
        num_layers=int(config["num_hidden_layers"]), bias=bool(config.get("medusa_fc_bias", False)),
    )  # fmt: skip
    return _drafter(medusa, folder, tensors, path)


def load_tgi(path: str) -> MedusaDrafter:
    """Read an original Medusa / TGI export by TGI's rules (no ``architectures``; blocks ``{h}.{l}.linear`` with a
    bias, the output layer ``{h}.{num_layers}``)."""
    folder = Path(path)
    config, tensors = read_folder(folder, "a Medusa export", TGI_WEIGHTS)
    if "architectures" in config:
        raise ModelFolderError(f"{path}: config.json has 'architectures', with which TGI disables Medusa speculation")
    heads, layers = int(config["medusa_num_heads"]), int(config["medusa_num_layers"])
    out = next((t for n, t in tensors.items() if n == f"0.{layers}.weight"), None)
    if out is None:
        raise ModelFolderError(f"{path}: no output layer 0.{layers}.weight for medusa_num_layers={layers}")
    renamed = {}
    for name, tensor in tensors.items():
        h, rest = name.split(".", 1)
        if rest == f"{layers}.weight":
            renamed[f"lm_heads.{h}.weight"] = tensor
        else:
            index, _, kind = rest.partition(".linear.")
            renamed[f"blocks.{h}.layers.{index}.{kind}"] = tensor
    medusa = MedusaConfig(
        hidden_size=int(out.shape[1]), vocab_size=int(out.shape[0]), num_heads=heads, num_layers=layers, bias=True
    )
    return _drafter(medusa, folder, renamed, path)
