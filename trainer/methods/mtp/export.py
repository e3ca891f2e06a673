"""MTP exports: the model with its modules in the DeepSeek NextN or the Qwen3-Next / Qwen3.5 layout, and the model
without them; with loaders that follow the engines' rules.

NextN (vLLM ``DeepSeekMTP``, SGLang ``DeepseekV3ForCausalLMNextN``; DeepSeek-V3-architecture models only): the full
model checkpoint, its config keeping ``num_hidden_layers = N`` and gaining ``num_nextn_predict_layers = D``; module
``k`` is decoder layer ``N + k`` under ``model.layers.{N + k}.``: ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H] over
``cat([enorm(embedding), hnorm(h)])``, ``shared_head.norm``, ``shared_head.head``, ``embed_tokens`` and the block's
own weights (in the checkpoint naming HF writes, e.g. one tensor per expert). ``shared_head.head`` and
``embed_tokens`` are written as exact copies of the target's lm_head and embedding: current vLLM replaces them with
the target's, SGLang ignores them, and the modules never had their own.

Qwen3-Next / Qwen3.5 (vLLM ``Qwen3NextMTP``, Qwen3.5 MTP): ``mtp.fc`` [H, 2H] over ``cat([pre_fc_norm_embedding(e),
pre_fc_norm_hidden(h)])``, ``mtp.layers.{i}.*``, ``mtp.norm``; one fc, one pair of input norms and one final norm for
all layers (so modules whose own differ cannot be written), config ``num_nextn_predict_layers`` (``qwen3_next`` and
other families) or ``mtp_num_hidden_layers`` (``qwen3_5``). No embedding or head is stored: the engine uses the
target's.

``hf``: the model without its modules, a plain HF checkpoint that transformers loads with no unexpected weight (the
MTP config keys set to 0).

The trunk's weights come from the drafter (a pre-training checkpoint holds the trunk it trained) or from the record's
target, copied file by file without any MTP tensor it held (a refresh replaces them). The loaders read every tensor
under the MTP prefixes into the modules by the engine's names (the block's through the inverse of HF's checkpoint
conversion, e.g. per-expert tensors into fused ones) and fail on a tensor left over, a missing one, a shape that
differs, or a NextN layer stored at another index than ``num_hidden_layers``.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers.core_model_loading import revert_weight_conversion

from trainer.data.vocab import TOKENIZER_FILES, load_tokenizer_if_present
from trainer.interface.errors import CheckpointError, ModelFolderError, UsageError
from trainer.methods.mtp.module import LAYOUTS, NEXTN_MODEL_TYPES, MTPConfig, MTPDrafter, text_config, trunk_parts
from trainer.methods.mtp.record import make_record
from trainer.models.target import (
    EMBEDDING_NAMES,
    LM_HEAD_NAMES,
    SAFETENSORS_INDEX,
    load_target_tensors,
    target_file,
    weight_map,
)
from trainer.training.registry import DrafterRecord

MTP_WEIGHTS = "model-mtp.safetensors"
NEXTN_OWN = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
QWEN3_NEXT_SHARED = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "norm": "norm"}
"""Qwen3-Next layout name -> the module attribute it is stored from (the same for every module)."""
QWEN3_5_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def mtp_count_key(model_type: str) -> str:
    """The config key that counts MTP layers in the Qwen3-Next / Qwen3.5 layout."""
    return "mtp_num_hidden_layers" if model_type in QWEN3_5_TYPES else "num_nextn_predict_layers"


_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")


def is_mtp_tensor(name: str, num_layers: int) -> bool:
    """A tensor of MTP modules in either layout (``mtp.*``, or a decoder layer at index ``num_layers`` or above)."""
    match = _LAYER.match(name)
    return name.startswith("mtp.") or (match is not None and int(match.group(1)) >= num_layers)


# ---------------------------------------------------------------------------------------------- block conversion


def block_tensors(config: MTPConfig, block: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """A block's weights under ``prefix`` in the checkpoint naming HF writes for the trunk's family."""
    skeleton = trunk_parts(config.trunk_config()).skeleton
    state = {prefix + k: v.detach().cpu().contiguous() for k, v in block.state_dict().items()}
    return {k: v.contiguous() for k, v in revert_weight_conversion(skeleton, state).items()}


def load_block(config: MTPConfig, block: nn.Module, prefix: str, tensors: dict[str, torch.Tensor], where: str) -> set:
    """Fill a block from checkpoint tensors named as :func:`block_tensors` writes them; returns the names consumed.

    The inverse of HF's checkpoint conversion is found by converting index tensors: every element of a checkpoint
    tensor lands where the conversion took it from (memory: one int64 copy of the largest parameter).
    """
    skeleton = trunk_parts(config.trunk_config()).skeleton
    consumed = set()
    for name, param in block.state_dict().items():
        probe = {prefix + name: torch.arange(param.numel()).view(param.shape)}
        filled = torch.zeros(param.numel(), dtype=torch.bool)
        flat = param.detach().clone().flatten()
        for ckpt_name, index in revert_weight_conversion(skeleton, probe).items():
            if ckpt_name not in tensors:
                raise ModelFolderError(f"{where}: tensor {ckpt_name} is missing (the block's {name})")
            source = tensors[ckpt_name]
            if tuple(source.shape) != tuple(index.shape):
                raise ModelFolderError(
                    f"{where}: tensor {ckpt_name} has shape {tuple(source.shape)}, the block needs {tuple(index.shape)}"
                )
            flat[index.flatten()] = source.flatten().to(flat.dtype)
            filled[index.flatten()] = True
            consumed.add(ckpt_name)
        if not bool(filled.all()):
            raise ModelFolderError(f"{where}: the block's {name} is not fully covered by the checkpoint's tensors")
        param.data.copy_(flat.view(param.shape))  # state_dict tensors share storage with the parameters
    return consumed


# ------------------------------------------------------------------------------------------------------- writers


def _check_conventions(config: MTPConfig, layout: str) -> None:
    """Refuse modules trained for other engine conventions than the layout's (the engine would run them wrongly)."""
    want = LAYOUTS[layout]
    have = (config.trunk_hidden, config.step_hidden, config.zero_first_position)
    if have != (want.trunk_hidden, want.step_hidden, want.zero_first_position):
        raise UsageError(
            f"the {layout} layout is served with trunk_hidden={want.trunk_hidden}, step_hidden={want.step_hidden}, "
            f"zero_first_position={want.zero_first_position}; these modules were trained with trunk_hidden="
            f"{config.trunk_hidden}, step_hidden={config.step_hidden}, zero_first_position="
            f"{config.zero_first_position} (train them with layout: {layout})"
        )


def _trunk_source(drafter: MTPDrafter, record: DrafterRecord, scratch: Path) -> str:
    """Where the trunk's files are: the record's target, or the drafter's own trunk saved to ``scratch``."""
    if drafter.trunk is not None:
        drafter.trunk.save_pretrained(scratch, safe_serialization=True)
        return str(scratch)
    if not record.target:
        raise CheckpointError("the drafter record names no target and holds no trunk: nothing to write the model from")
    return record.target


def _read_config(source: str) -> dict:
    """The config.json of a local folder or hub id ({} when it has none)."""
    try:
        path = target_file(source, "config.json")
    except FileNotFoundError:
        return {}
    return json.loads(path.read_text()) if path is not None else {}


def _set_key(config: dict, key: str, value: int) -> None:
    """Set ``key`` at the top level and in a nested ``text_config`` (multimodal configs)."""
    config[key] = value
    if isinstance(config.get("text_config"), dict):
        config["text_config"][key] = value


def _write_model(
    drafter: MTPDrafter, record: DrafterRecord, out: Path, mtp: dict[str, torch.Tensor], counts: dict[str, int]
) -> Path:
    """The trunk's files (without MTP tensors) and ``mtp`` in their own file, an index over both, the config with
    ``counts`` set, and the tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    N = drafter.mtp.num_trunk_layers
    if record.target and drafter.trunk is None and Path(record.target).resolve() == out.resolve():
        raise UsageError(f"--output_dir {out} is the target's own folder: write the export elsewhere")
    with tempfile.TemporaryDirectory() as scratch:
        source = _trunk_source(drafter, record, Path(scratch))
        files: dict[Path, list[str]] = {}
        for name, file in weight_map(source).items():
            files.setdefault(file, []).append(name)
        index: dict[str, str] = {}
        total = 0
        for file, names in sorted(files.items()):
            keep = {}
            with safe_open(str(file), framework="pt") as f:
                metadata = f.metadata()
                for name in names:
                    if not is_mtp_tensor(name, N):
                        keep[name] = f.get_tensor(name)
            if not keep:  # a file of MTP tensors only (the MTP file of an earlier export)
                continue
            save_file(keep, str(out / file.name), metadata=metadata or {"format": "pt"})
            index.update(dict.fromkeys(keep, file.name))
            total += sum(t.numel() * t.element_size() for t in keep.values())
        if mtp:
            save_file(mtp, str(out / MTP_WEIGHTS), metadata={"format": "pt"})
            index.update(dict.fromkeys(mtp, MTP_WEIGHTS))
            total += sum(t.numel() * t.element_size() for t in mtp.values())
        if len(set(index.values())) > 1 or (out / SAFETENSORS_INDEX).exists():
            body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}
            (out / SAFETENSORS_INDEX).write_text(json.dumps(body, indent=2) + "\n")
        config = _read_config(source)
        if not config:
            raise FileNotFoundError(f"{source}: no config.json")
        for key, value in counts.items():
            _set_key(config, key, value)
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = target_file(source, "generation_config.json")
        if generation is not None:
            shutil.copy(generation, out / "generation_config.json")
    tokenizer = load_tokenizer_if_present(record.tokenizer) if record.tokenizer else None
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def _shared_tensors(drafter: MTPDrafter, record: DrafterRecord) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and lm_head, as stored (the drafter's trunk, or read from the target's files)."""
    if drafter.trunk is not None:
        embedding = drafter.trunk.get_input_embeddings().weight
        head = drafter.trunk.get_output_embeddings().weight
        return embedding.detach().cpu().clone(), head.detach().cpu().clone()
    tensors = load_target_tensors(record.target, {"embedding": EMBEDDING_NAMES})
    try:
        head = load_target_tensors(record.target, {"lm_head": LM_HEAD_NAMES})["lm_head"]
    except ValueError:  # tied: the embedding is the output layer
        head = tensors["embedding"]
    return tensors["embedding"], head


def write_nextn(drafter: MTPDrafter, record: DrafterRecord, out: Path) -> Path:
    """The DeepSeek NextN layout (module docstring); refuses a trunk that is not DeepSeek-V3-architecture."""
    config = drafter.config
    model_type = text_config(config.trunk_config()).model_type
    if model_type not in NEXTN_MODEL_TYPES:
        raise UsageError(
            f"the NextN layout is loaded for DeepSeek-V3-architecture models ({', '.join(sorted(NEXTN_MODEL_TYPES))})"
            f"; this trunk is model_type {model_type!r}: write --format qwen3-next (the mtp.* layout) or hf"
        )
    _check_conventions(config, "nextn")
    embedding, head = _shared_tensors(drafter, record)
    N = drafter.mtp.num_trunk_layers
    tensors: dict[str, torch.Tensor] = {}
    for k, layer in enumerate(drafter.mtp.layers):
        prefix = f"model.layers.{N + k}."
        own = {
            "enorm.weight": layer.enorm.weight, "hnorm.weight": layer.hnorm.weight,
            "eh_proj.weight": layer.eh_proj.weight, "shared_head.norm.weight": layer.norm.weight,
        }  # fmt: skip
        tensors.update({prefix + n: t.detach().cpu().contiguous() for n, t in own.items()})
        tensors[prefix + "shared_head.head.weight"] = head.clone()
        tensors[prefix + "embed_tokens.weight"] = embedding.clone()
        tensors.update(block_tensors(config, layer.block, prefix))
    return _write_model(drafter, record, Path(out), tensors, {"num_nextn_predict_layers": config.depth})


def write_qwen3_next(drafter: MTPDrafter, record: DrafterRecord, out: Path) -> Path:
    """The Qwen3-Next / Qwen3.5 ``mtp.*`` layout (module docstring)."""
    config = drafter.config
    _check_conventions(config, "qwen3_next")
    layers = drafter.mtp.layers
    first = layers[0]
    for k, layer in enumerate(layers):
        for ours in QWEN3_NEXT_SHARED.values():
            if not torch.equal(getattr(layer, ours).weight, getattr(first, ours).weight):
                raise UsageError(
                    f"the Qwen3-Next layout stores one fc, input norms and final norm for all MTP layers; module {k}'s "
                    f"{ours} differs from module 0's ({len(layers)} modules trained with their own)"
                )
    tensors = {
        f"mtp.{theirs}.weight": getattr(first, ours).weight.detach().cpu().contiguous()
        for theirs, ours in QWEN3_NEXT_SHARED.items()
    }
    for k, layer in enumerate(layers):
        tensors.update(block_tensors(config, layer.block, f"mtp.layers.{k}."))
    model_type = text_config(config.trunk_config()).model_type
    return _write_model(drafter, record, Path(out), tensors, {mtp_count_key(model_type): config.depth})


def write_hf(drafter: MTPDrafter, record: DrafterRecord, out: Path) -> Path:
    """The model without its modules: a plain HF checkpoint (MTP config keys set to 0)."""
    source_config = text_config(drafter.config.trunk_config())
    counts = {key: 0 for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers") if hasattr(source_config, key)}
    return _write_model(drafter, record, Path(out), {}, counts)


# ------------------------------------------------------------------------------------------------------- loaders


def _tensor_names(source: str | Path) -> list[str]:
    try:
        return list(weight_map(str(source)))
    except (OSError, ValueError):
        return []


def _read(source: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a checkpoint, each file opened once."""
    files = weight_map(str(source))
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for file, group in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in group})
    return out


def _loaded_record(drafter: MTPDrafter, source: str) -> DrafterRecord:
    """The record of modules read from a model checkpoint: the checkpoint is also their target."""
    text = text_config(drafter.config.trunk_config())
    local = Path(source).is_dir()
    has_tokenizer = not local or any((Path(source) / f).is_file() for f in TOKENIZER_FILES)
    architectures = list(getattr(text, "architectures", None) or [])
    return make_record(
        drafter.config, source, architectures, with_trunk=False, tokenizer=source if has_tokenizer else None
    )


def _trunk_dict(source: str) -> dict:
    """The checkpoint's config as the modules' trunk config."""
    from transformers import AutoConfig

    if "model_type" not in _read_config(source):
        raise ModelFolderError(f"{source}: config.json has no model_type")
    return json.loads(json.dumps(AutoConfig.from_pretrained(source).to_dict(), default=str))


def _layer_index(name: str) -> int | None:
    match = _LAYER.match(name)
    return None if match is None else int(match.group(1))


def recognise_nextn(folder: Path | str) -> bool:
    """A DeepSeek-V3-architecture checkpoint whose config counts NextN layers and whose layer N has an eh_proj."""
    config = _read_config(str(folder))
    if config.get("model_type") not in NEXTN_MODEL_TYPES or not int(config.get("num_nextn_predict_layers") or 0):
        return False
    return f"model.layers.{config.get('num_hidden_layers')}.eh_proj.weight" in _tensor_names(folder)


def load_nextn(folder: Path | str) -> tuple[MTPDrafter, DrafterRecord]:
    """The modules of a NextN checkpoint by vLLM's rules: layers ``N .. N + n - 1`` are the MTP layers (their
    ``embed_tokens`` and ``shared_head.head`` are consumed and replaced by the target's); a layer stored at any other
    index from N up is an error naming it."""
    source = str(folder)
    config = _read_config(source)
    N, n = int(config.get("num_hidden_layers") or 0), int(config.get("num_nextn_predict_layers") or 0)
    spec = [m for m in _tensor_names(source) if is_mtp_tensor(m, N)]
    found = sorted({i for i in map(_layer_index, spec) if i is not None})
    if n < 1 or found != list(range(N, N + n)):
        raise ModelFolderError(
            f"{source}: NextN layers stored at index {found}, but num_hidden_layers is {N} and "
            f"num_nextn_predict_layers {n}: the NextN layers must be stored as layers {list(range(N, N + n))} (the "
            "first at index num_hidden_layers)"
        )
    mtp_config = MTPConfig(depth=n, trunk=_trunk_dict(source), layout="nextn", **asdict(LAYOUTS["nextn"]))
    tensors = _read(source, spec)
    drafter = MTPDrafter(mtp_config).to(tensors[f"model.layers.{N}.eh_proj.weight"].dtype)  # the stored precision
    consumed: set[str] = set()
    for k, layer in enumerate(drafter.mtp.layers):
        prefix = f"model.layers.{N + k}."
        own = {"enorm": layer.enorm, "hnorm": layer.hnorm, "eh_proj": layer.eh_proj, "shared_head.norm": layer.norm}
        for name, module in own.items():
            consumed.add(_copy(module.weight, tensors, f"{prefix}{name}.weight", source))
        consumed |= {prefix + "shared_head.head.weight", prefix + "embed_tokens.weight"} & set(tensors)
        block = {
            m: t for m, t in tensors.items() if m.startswith(prefix) and not m[len(prefix) :].startswith(NEXTN_OWN)
        }
        consumed |= load_block(mtp_config, layer.block, prefix, block, source)
    left = sorted(set(tensors) - consumed)
    if left:
        raise ModelFolderError(f"{source}: NextN tensors not consumed by the loader: {left[:8]}")
    return drafter, _loaded_record(drafter, source)


def nextn_copies(folder: Path | str) -> dict[str, torch.Tensor]:
    """The ``embed_tokens`` and ``shared_head.head`` tensors of a NextN checkpoint's MTP layers."""
    names = [m for m in _tensor_names(folder) if m.endswith(("shared_head.head.weight", ".embed_tokens.weight"))]
    return _read(folder, [m for m in names if m.startswith("model.layers.")])


def recognise_qwen3_next(folder: Path | str) -> bool:
    """A checkpoint with a config and an ``mtp.fc`` tensor."""
    return bool(_read_config(str(folder))) and "mtp.fc.weight" in _tensor_names(folder)


def load_qwen3_next(folder: Path | str) -> tuple[MTPDrafter, DrafterRecord]:
    """The modules of an ``mtp.*`` checkpoint by vLLM's Qwen3-Next rules: one fc and norms shared by all layers."""
    source = str(folder)
    trunk = _trunk_dict(source)
    text = text_config_dict(trunk)
    key = mtp_count_key(text.get("model_type", trunk["model_type"]))
    n = int(text.get(key) or trunk.get(key) or 0)
    spec = [m for m in _tensor_names(source) if m.startswith("mtp.")]
    indices = sorted({int(m.split(".")[2]) for m in spec if m.startswith("mtp.layers.")})
    if n < 1 or indices != list(range(n)):
        raise ModelFolderError(f"{source}: mtp.layers {indices} stored, but config {key} is {n} (layers 0..{n - 1})")
    mtp_config = MTPConfig(depth=n, trunk=trunk, layout="qwen3_next", **asdict(LAYOUTS["qwen3_next"]))
    tensors = _read(source, spec)
    if "mtp.fc.weight" not in tensors:
        raise ModelFolderError(f"{source}: tensor mtp.fc.weight is missing")
    drafter = MTPDrafter(mtp_config).to(tensors["mtp.fc.weight"].dtype)  # the stored precision
    consumed: set[str] = set()
    for k, layer in enumerate(drafter.mtp.layers):
        for theirs, ours in QWEN3_NEXT_SHARED.items():
            consumed.add(_copy(getattr(layer, ours).weight, tensors, f"mtp.{theirs}.weight", source))
        prefix = f"mtp.layers.{k}."
        consumed |= load_block(
            mtp_config, layer.block, prefix, {m: t for m, t in tensors.items() if m.startswith(prefix)}, source
        )
    left = sorted(set(tensors) - consumed)
    if left:
        raise ModelFolderError(f"{source}: mtp tensors not consumed by the loader: {left[:8]}")
    return drafter, _loaded_record(drafter, source)


def _copy(param: torch.Tensor, tensors: dict[str, torch.Tensor], name: str, source: str) -> str:
    """Copy checkpoint tensor ``name`` into ``param``; returns the name."""
    if name not in tensors:
        raise ModelFolderError(f"{source}: tensor {name} is missing")
    if tuple(tensors[name].shape) != tuple(param.shape):
        raise ModelFolderError(
            f"{source}: tensor {name} has shape {tuple(tensors[name].shape)}, expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensors[name].to(param.dtype))
    return name


def text_config_dict(config: dict) -> dict:
    """The text part of a (possibly multimodal) config dict."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def load_model_modules(name_or_path: str) -> tuple[MTPDrafter, DrafterRecord] | None:
    """The MTP modules a model checkpoint (folder or hub id) holds in either layout, or None when it holds none; a
    NextN layer at another index than ``num_hidden_layers`` is an error naming it."""
    if recognise_nextn(name_or_path):
        return load_nextn(name_or_path)
    if recognise_qwen3_next(name_or_path):
        return load_qwen3_next(name_or_path)
    config = _read_config(name_or_path)
    N = int(text_config_dict(config).get("num_hidden_layers") or 0)
    if any(_layer_index(m) is not None and _layer_index(m) >= N for m in _tensor_names(name_or_path)):
        return load_nextn(name_or_path)  # layers beyond the trunk that the config does not place: named there
    return None
