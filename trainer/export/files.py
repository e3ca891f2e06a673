"""The files of an exported drafter folder with one ``config.json`` beside one safetensors file of weights, written
and read the same way by every format of that shape (EAGLE-3, DFlash, Medusa)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from trainer.interface.errors import ModelFolderError, PathError

WEIGHTS = "model.safetensors"


def cpu_tensors(module: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The module's state dict as contiguous CPU tensors, cast to ``dtype`` when one is given."""
    out = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    return {k: v.to(dtype) for k, v in out.items()} if dtype is not None else out


def write_folder(out_dir: str | Path, config: dict, tensors: dict[str, torch.Tensor], weights: str = WEIGHTS) -> Path:
    """``config.json`` and the ``weights`` safetensors file in ``out_dir`` (created when missing)."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    try:
        save_file(tensors, str(path / weights), metadata={"format": "pt"})
    except SafetensorError as err:  # safetensors reports a full disk or an I/O error as its own error, not OSError
        (path / weights).unlink(missing_ok=True)  # a partial file would read as a truncated export
        raise PathError(
            f"{path / weights}: could not be written ({err})", "free space on its disk, or choose another --output_dir"
        ) from err
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def read_folder(path: str | Path, what: str, weights: str = WEIGHTS) -> tuple[dict, dict[str, torch.Tensor]]:
    """The config and tensors of a folder :func:`write_folder` wrote.

    Raises:
        PathError: a missing file, named (``not {what}``).
        ModelFolderError: a ``config.json`` that is not JSON, or a weights file that is empty, truncated or not
            safetensors, named.
    """
    from trainer.models.target import safetensors_error

    folder = Path(path)
    for name in ("config.json", weights):
        if not (folder / name).is_file():
            raise PathError(f"{folder / name}: missing (not {what})")
    config = read_config(folder / "config.json", what)
    try:
        tensors = load_file(str(folder / weights))
    except SafetensorError as err:
        raise safetensors_error(folder / weights, what, err) from err
    return config, tensors


def read_config(path: Path, what: str) -> dict:
    """A ``config.json`` of ``what``; one that is not a JSON object is a :class:`ModelFolderError` naming it."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelFolderError(f"{what}: {path} is not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise ModelFolderError(f"{what}: {path} holds a {type(config).__name__}, not a JSON object")
    return config


def folder_config(folder: Path) -> dict:
    """A folder's ``config.json``, or {} when it has none (what the kinds' ``recognise`` tests read)."""
    path = folder / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}
