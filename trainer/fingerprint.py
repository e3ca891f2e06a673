"""Fingerprints of frozen models: what a checkpoint stores instead of their weights.

Training checkpoints hold what training changes (trainable weights, optimizer and schedule, data position, the
drafter record). A frozen target or teacher is rebuilt from its path on resume, and the checkpoint keeps a
fingerprint of it to refuse a different one: its path, a hash of its config, a hash of its weights' names, shapes and
dtypes, and a hash of a sample of their values (the first values of every tensor, rounded to bfloat16 so that the
same weights loaded in float32 or bfloat16 agree). The weights are read from the model's safetensors files (their
headers and one small slice per tensor), so a model that was never built, as in training from shards, has the same
fingerprint as one that was.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import torch

SAMPLE = 16  # values read from the start of every tensor
VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _sample(tensor: torch.Tensor) -> bytes:
    """The first values of a tensor (its first row for a matrix), as bfloat16 bytes."""
    head = tensor[:1] if tensor.ndim > 1 else tensor[:SAMPLE]
    values = head.flatten()[:SAMPLE].to(torch.float32).to(torch.bfloat16)
    return values.view(torch.int16).numpy().tobytes()


def config_hash(config) -> str:
    """A hash of an HF config without the keys that change when the same model is saved or loaded differently."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    for key in VOLATILE_CONFIG_KEYS:
        data.pop(key, None)
    return _sha(json.dumps(data, sort_keys=True, default=str).encode())


def fingerprint(name_or_path: str, config, tensors: Mapping[str, torch.Tensor] | None = None) -> dict[str, str]:
    """The fingerprint of a frozen model.

    Args:
        name_or_path: its directory or hub id.
        config: its HF config.
        tensors: its weights, used when the model has no safetensors files to read (None: read the files).
    """
    from safetensors import safe_open

    from trainer.target import weight_map

    shapes, sample = hashlib.sha256(), hashlib.sha256()
    try:
        files = weight_map(name_or_path)
    except (OSError, ValueError):
        if tensors is None:
            raise
        files = None
    if files is not None:
        by_file: dict = {}
        for name, file in files.items():
            by_file.setdefault(file, []).append(name)
        entries = {}
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in names:
                    part = f.get_slice(name)
                    shape = list(part.get_shape())
                    head = part[:1] if len(shape) > 1 else part[:SAMPLE]
                    entries[name] = (shape, str(part.get_dtype()), _sample(head))
    else:
        entries = {n: (list(t.shape), str(t.dtype), _sample(t.detach().cpu())) for n, t in tensors.items()}
    for name in sorted(entries):
        shape, dtype, values = entries[name]
        shapes.update(f"{name}:{shape}:{dtype};".encode())
        sample.update(values)
    return {
        "path": str(name_or_path),
        "config": config_hash(config),
        "weights": shapes.hexdigest()[:16],
        "sample": sample.hexdigest()[:16],
    }


def describe(print_: Mapping[str, str]) -> str:
    """One line for error messages."""
    return ", ".join(f"{k} {v}" for k, v in print_.items())
