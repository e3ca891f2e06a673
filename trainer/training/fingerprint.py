"""Fingerprints of frozen models: what a checkpoint stores instead of their weights.

Training checkpoints hold what training changes (trainable weights, optimizer and schedule, data position, the
drafter record). A frozen target or teacher is rebuilt from its path on resume, and the checkpoint keeps a
fingerprint of it to refuse a different one: its path, a hash of its config, a hash of its weights' names, shapes and
dtypes, and a hash of a sample of their values (the first values of every tensor, rounded to bfloat16 so that the
same weights loaded in float32 or bfloat16 agree). The weights are read from the model's safetensors files (their
headers and one small slice per tensor), so a model that was never built, as in training from shards, has the same
fingerprint as one that was.

``draftsmith eval`` reads a training checkpoint's recorded fingerprints (:func:`recorded_fingerprints`) and compares
the target's with the ``--target`` folder's (:func:`differences`: the path aside). ``draftsmith export`` writes the
target's fingerprint beside every exported folder (:data:`EXPORT_RECORD`, :func:`write_export_record`), which eval
compares the same way; the record also names the version of draftsmith that wrote it (:func:`export_version`;
records written before 0.21.0 hold none and are read as before). A drafter that trained its target and carries it
(Medusa-2's model, an MTP pre-training's trunk) is compared with ``--target`` by the sampled values of the weights
both hold (:func:`sample_differences`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch

from trainer import __version__

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


def _file_entries(files: Mapping[str, Path]) -> dict[str, tuple[list[int], str, bytes]]:
    """Tensor name -> (shape, dtype, sampled values) read from safetensors files (name -> file): headers and one
    small slice per tensor."""
    from safetensors import safe_open

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
    return entries


def _tensor_entries(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[list[int], str, bytes]]:
    """Tensor name -> (shape, dtype, sampled values) of tensors in memory."""
    return {n: (list(t.shape), str(t.dtype), _sample(t.detach().cpu())) for n, t in tensors.items()}


def fingerprint(name_or_path: str, config, tensors: Mapping[str, torch.Tensor] | None = None) -> dict[str, str]:
    """The fingerprint of a frozen model.

    Args:
        name_or_path: its directory or hub id.
        config: its HF config.
        tensors: its weights, used when the model has no safetensors files to read (None: read the files).
    """
    from trainer.models.target import weight_map

    shapes, sample = hashlib.sha256(), hashlib.sha256()
    try:
        files = weight_map(name_or_path)
    except (OSError, ValueError):
        if tensors is None:
            raise
        files = None
    if files is not None:
        entries = _file_entries(files)
    else:
        entries = _tensor_entries(tensors)
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


COMPARED = ("config", "weights", "sample")  # what identifies a model; its path does not (a copy is the same model)


def differences(recorded: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    """The parts of two fingerprints that differ, of those both hold (:data:`COMPARED`); [] for the same model."""
    return [k for k in COMPARED if k in recorded and k in current and recorded[k] != current[k]]


def recorded_fingerprints(checkpoint: str | Path) -> dict[str, dict[str, str]]:
    """The fingerprints a training checkpoint recorded (``checkpoint["frozen_models"]``: name -> fingerprint, e.g.
    ``target``, or ``teacher`` for KD), {} when it recorded none.

    A ``.ckpt`` file, the rank-0 client state of a DeepSpeed checkpoint folder or the ``meta.pt`` of a distributed
    (FSDP2) one is opened memory-mapped: the weights it holds are not read.
    """
    from trainer.checkpoints.reading import client_state_file, explain_load_error
    from trainer.interface.errors import CheckpointError

    path = client_state_file(Path(checkpoint))
    if path is None:
        return {}
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        explained = explain_load_error(path, err)
        if explained is None:
            raise
        raise explained from err
    frozen = data.get("frozen_models") if isinstance(data, dict) else None
    if frozen is not None and not isinstance(frozen, dict):
        raise CheckpointError(f"checkpoint {checkpoint}: frozen_models is a {type(frozen).__name__}, not a mapping")
    return dict(frozen or {})


EXPORT_RECORD = "target_fingerprint.json"  # beside an exported drafter: the fingerprint of the target it was made for
EXPORT_VERSION_KEY = "draftsmith_version"  # in EXPORT_RECORD: the draftsmith that wrote the export (from 0.21.0)


def write_export_record(folder: str | Path, target: Mapping[str, str]) -> Path:
    """Writes ``target``'s fingerprint beside an exported drafter (:data:`EXPORT_RECORD`), with the version of
    draftsmith that wrote it (:data:`EXPORT_VERSION_KEY`); engines ignore the file."""
    path = Path(folder) / EXPORT_RECORD
    record = {"target": dict(target), EXPORT_VERSION_KEY: __version__}
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def _read_export_record(folder: str | Path) -> tuple[Path, object]:
    """The path of ``folder``'s :data:`EXPORT_RECORD` and its parsed JSON (None when there is no such file).

    Raises:
        ModelFolderError: a record that is not JSON, naming the file.
    """
    from trainer.interface.errors import ModelFolderError

    path = Path(folder) / EXPORT_RECORD
    if not path.is_file():
        return path, None
    try:
        return path, json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelFolderError(f"{path}: not JSON ({err})") from err


def export_record(folder: str | Path) -> dict[str, str] | None:
    """The target fingerprint an exported folder records (:func:`write_export_record`), None when it has none.

    Raises:
        ModelFolderError: a record that is not JSON or holds no ``target`` mapping of strings, naming the file.
    """
    from trainer.interface.errors import ModelFolderError

    path, data = _read_export_record(folder)
    if data is None:
        return None
    target = data.get("target") if isinstance(data, dict) else None
    if not isinstance(target, dict) or not all(isinstance(v, str) for v in target.values()):
        raise ModelFolderError(f"{path}: holds no 'target' fingerprint (a mapping of strings)")
    return target


def export_version(folder: str | Path) -> str | None:
    """The version of draftsmith that wrote an exported folder (:data:`EXPORT_VERSION_KEY` in its
    :data:`EXPORT_RECORD`); None when the folder has no record, or one written before 0.21.0, which held none.

    Raises:
        ModelFolderError: a record that is not JSON, naming the file.
    """
    _, data = _read_export_record(folder)
    version = data.get(EXPORT_VERSION_KEY) if isinstance(data, dict) else None
    return version if isinstance(version, str) else None


def sample_differences(
    tensors: Mapping[str, torch.Tensor] | str | Path, name_or_path: str | Path
) -> tuple[int, list[str]]:
    """Compares weights (in memory, as a drafter's carried target, or a model folder's) with a model folder's
    safetensors weights, tensor by tensor, by their sampled values (:func:`fingerprint`'s sample: bfloat16-rounded,
    so a float32 copy and a bfloat16 save of the same weights agree).

    Args:
        tensors: name -> tensor, or the folder (or hub id) whose safetensors weights are compared.
        name_or_path: the model folder (or hub id) compared with.

    Returns:
        (the number of tensor names both hold with one shape, the names among them whose sampled values differ);
        (0, []) means no weight in common to compare.
    """
    from trainer.models.target import weight_map

    if isinstance(tensors, (str, Path)):
        ours = _file_entries(weight_map(str(tensors)))
    else:
        ours = _tensor_entries(tensors)
    theirs = _file_entries({n: f for n, f in weight_map(str(name_or_path)).items() if n in ours})
    common = sorted(n for n in theirs if ours[n][0] == theirs[n][0])
    return len(common), [n for n in common if ours[n][2] != theirs[n][2]]
