"""Reads a training checkpoint into a plain state dict, whatever strategy wrote it.

A Lightning checkpoint file is read with ``torch.load(weights_only=True)``, memory-mapped (a tensor is read from
disk when it is used: exporting a drafter never reads the optimizer's moments, two thirds of an AdamW checkpoint); a
DeepSpeed checkpoint directory is
consolidated to full float32 tensors first; an FSDP2 distributed checkpoint directory (``.metadata``, one ``.distcp``
file per rank, Lightning's ``meta.pt``) has its shards put together in the model's dtype. Objectives record in the
checkpoint what the drafter is (``checkpoint["drafter"]``: its kind, config and the state-dict prefix of its weights),
so exporters never need to load the target to rebuild it.

A file that is not a whole checkpoint is refused naming it: empty, truncated (a save that did not finish, a copy cut
short), another kind of file, or a pickle holding objects that no checkpoint draftsmith writes holds (a class of
some module, a function such as ``os.system``): ``weights_only`` refuses those without running anything, and the
error names what the file asked for. A DeepSpeed folder's files are screened the same way before DeepSpeed, which
unpickles them with ``weights_only=False``, reads them.
"""

from __future__ import annotations

import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any, Literal

import torch

from trainer.interface.errors import CheckpointError, PathError

_ZIP_MAGIC = b"PK\x03\x04"
# Globals a DeepSpeed checkpoint folder's files name besides what weights_only allows by default (its ZeRO stage enum,
# loss scalers and fragment records), by exact name: a module prefix would let a pickle reach any function through a
# dotted name (``deepspeed.x.subprocess.run``).
_DEEPSPEED_GLOBALS = frozenset(
    {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)


def _not_a_checkpoint(path: Path, what: str, reason: str) -> CheckpointError:
    return CheckpointError(
        f"{what} {path}: {reason}",
        hint="point to a whole checkpoint (an older one in the same folder, or save it again); "
        "a file cut short by a full disk or an interrupted copy cannot be repaired",
    )


def _unsafe_globals(path: Path) -> list[str]:
    """The globals (classes, functions) a ``torch.save`` zip's pickle names beyond what weights_only allows, read
    without unpickling anything; [] when they cannot be listed."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception:  # a pickle torch cannot scan: the caller's message stands without the list
        return []


def _refused(path: Path, what: str, names: list[str]) -> CheckpointError:
    held = f" ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})" if names else ""
    return CheckpointError(
        f"{what} {path}: refused: it holds objects no checkpoint draftsmith writes holds{held}, which unpickling "
        "would import or run; nothing in it was run",
        hint="use a checkpoint draftsmith wrote; do not load this file with weights_only=False unless you trust "
        "whoever made it",
    )


DEEPSPEED_CLIENT_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
"""Rank 0's model-states file of a DeepSpeed checkpoint's ``checkpoint/`` folder (ZeRO-1/2, then ZeRO-3), which holds
Lightning's client state: the drafter record and the frozen models' fingerprints."""


def checkpoint_layout(path: Path) -> Literal["file", "deepspeed", "distributed"] | None:
    """What a training checkpoint path is: a Lightning ``.ckpt`` file, a DeepSpeed checkpoint folder (its
    ``checkpoint/`` folder), an FSDP2 distributed checkpoint folder (its ``.metadata`` index), or None (neither)."""
    if path.is_file():
        return "file"
    if (path / ".metadata").is_file():
        return "distributed"
    if (path / "checkpoint").is_dir():
        return "deepspeed"
    return None


def client_state_file(path: Path) -> Path | None:
    """The file of a training checkpoint that holds Lightning's client state (read memory-mapped, its weights
    untouched): the ``.ckpt`` file, rank 0's DeepSpeed model states or the distributed folder's ``meta.pt``; None where
    the layout has no such file."""
    layout = checkpoint_layout(path)
    if layout == "file":
        return path
    if layout == "distributed":
        return path / "meta.pt" if (path / "meta.pt").is_file() else None
    if layout == "deepspeed":
        return next((f for f in (path / "checkpoint" / n for n in DEEPSPEED_CLIENT_STATES) if f.is_file()), None)
    return None


def explain_load_error(path: Path, err: BaseException, what: str = "checkpoint") -> CheckpointError | None:
    """The :class:`CheckpointError` that says why ``torch.load`` of ``path`` failed with ``err`` (empty, truncated,
    not a checkpoint, refused objects), or None when ``err`` is none of those (a bug, a device error: re-raise it)."""
    refused = isinstance(err, pickle.UnpicklingError) and "weights only load failed" in str(err).lower()
    size = path.stat().st_size if path.is_file() else 0
    if size == 0:
        return _not_a_checkpoint(path, what, "empty file (0 bytes): not a checkpoint")
    with open(path, "rb") as f:
        head = f.read(4)
    if head == _ZIP_MAGIC and not zipfile.is_zipfile(path):
        return _not_a_checkpoint(
            path, what, f"truncated ({size:,} bytes, the zip archive has no end): not a whole checkpoint"
        )
    if head != _ZIP_MAGIC:
        if refused and head[:1] == b"\x80":  # a bare pickle (protocol 2+), not torch.save's zip
            return _refused(path, what, [])
        return _not_a_checkpoint(path, what, "not a checkpoint (not a file torch.save wrote)")
    if refused:
        return _refused(path, what, _unsafe_globals(path))
    if isinstance(err, (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, KeyError, ValueError)):
        reason = str(err).split(". ")[0].strip()
        return _not_a_checkpoint(path, what, f"corrupted ({reason}): not a whole checkpoint")
    return None


def torch_load_checked(path: str | Path, what: str = "checkpoint") -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``, memory-mapped when the file is torch.save's zip
    (its tensors read from disk as they are used); a file that is not a whole checkpoint, or one holding objects
    weights_only refuses, is a :class:`CheckpointError` naming it (see :func:`explain_load_error`).

    Args:
        path: the file.
        what: what the file is, for the message (``checkpoint``, ``DeepSpeed client state``...).
    """
    file = Path(path)
    if not file.is_file():
        raise PathError(f"{what} {file}: no such file")
    if file.stat().st_size == 0:
        raise _not_a_checkpoint(file, what, "empty file (0 bytes): not a checkpoint")
    with open(file, "rb") as f:
        zipped = f.read(4) == _ZIP_MAGIC  # mmap reads only torch.save's zip; anything else is explained below
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=zipped)
    except Exception as err:
        explained = explain_load_error(file, err, what)
        if explained is None:
            raise
        raise explained from err


def _screen_deepspeed_folder(folder: Path) -> None:
    """Refuses a DeepSpeed checkpoint folder whose files name globals beyond tensors and DeepSpeed's own records:
    DeepSpeed's consolidation unpickles them with ``weights_only=False``, which would run them."""
    for file in sorted(folder.rglob("*.pt")):
        if file.stat().st_size == 0:
            raise _not_a_checkpoint(file, "DeepSpeed checkpoint file", "empty file (0 bytes)")
        if not zipfile.is_zipfile(file):
            with open(file, "rb") as f:
                truncated = f.read(4) == _ZIP_MAGIC
            reason = "truncated (the zip archive has no end)" if truncated else "not a file torch.save wrote"
            raise _not_a_checkpoint(file, "DeepSpeed checkpoint file", reason)
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(str(file))
        except Exception as err:
            raise _not_a_checkpoint(file, "DeepSpeed checkpoint file", f"unreadable ({err})") from err
        foreign = [n for n in names if n not in _DEEPSPEED_GLOBALS]
        if foreign:
            raise _refused(file, "DeepSpeed checkpoint file", foreign)


def _read_distributed_folder(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state_dict, drafter record) of a ``torch.distributed.checkpoint`` folder, as FSDP2 with
    ``save_distributed_checkpoint`` writes it: every rank's shards of the model's tensors (``__R_0.distcp``, indexed by
    ``.metadata``) put together in this one process, and Lightning's other entries in ``meta.pt``."""
    meta_file = folder / "meta.pt"
    if not meta_file.is_file():
        raise PathError(
            f"{str(folder)!r} is a distributed checkpoint folder without its meta.pt (not one Lightning wrote)"
        )
    meta = torch_load_checked(meta_file, "distributed checkpoint metadata")
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(folder))
    try:
        index = reader.read_metadata()
    except Exception as err:
        raise _not_a_checkpoint(folder / ".metadata", "distributed checkpoint index", f"unreadable ({err})") from err
    weights: dict[str, torch.Tensor] = {}
    for key, item in index.state_dict_metadata.items():
        where = index.planner_data.get(key) if index.planner_data else None
        if isinstance(item, TensorStorageMetadata) and where and len(where) == 2 and where[0] == "state_dict":
            weights[where[1]] = torch.empty(item.size, dtype=item.properties.dtype)
    if not weights:
        raise CheckpointError(f"checkpoint {folder}: its distributed checkpoint holds no state_dict tensors")
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is what is meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            load({"state_dict": weights}, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as err:  # a shard file missing or cut short (a BaseException)
        last = (str(err).strip().splitlines() or [type(err).__name__])[-1]  # a rank's traceback ends in its error
        raise _not_a_checkpoint(
            folder, "distributed checkpoint folder", f"a shard file is unreadable ({last})"
        ) from err
    return weights, meta.get("drafter", {}) if isinstance(meta, dict) else {}


def load_training_checkpoint(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Returns (state_dict, drafter record) of a ``.ckpt`` file, a DeepSpeed checkpoint directory or an FSDP2
    distributed checkpoint directory.

    Raises:
        PathError: ``path`` does not exist, or is a folder that is neither checkpoint folder.
        CheckpointError: a file that is empty, truncated, not a checkpoint, or holds objects no draftsmith checkpoint
            holds (refused before anything in it runs); a file without a state dict.
    """
    ckpt = Path(path)
    if not ckpt.exists():
        raise PathError(f"checkpoint {path!r} does not exist")
    layout = checkpoint_layout(ckpt)
    if layout == "distributed":
        return _read_distributed_folder(ckpt)
    if ckpt.is_dir():
        # ZeRO-1/2 write mp_rank_00_model_states.pt, ZeRO-3 one zero_pp_rank_R_mp_rank_00_model_states.pt per rank;
        # rank 0's holds Lightning's client state, the drafter record among it
        client_state = client_state_file(ckpt)
        if client_state is None:
            raise PathError(
                f"{path!r} is a directory but not a checkpoint folder (no DeepSpeed "
                f"checkpoint/{DEEPSPEED_CLIENT_STATES[0]}, no distributed checkpoint .metadata)"
            )
        meta = torch_load_checked(client_state, "DeepSpeed checkpoint file")
        _screen_deepspeed_folder(ckpt / "checkpoint")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
        state = {k.removeprefix("_forward_module."): v for k, v in state.items()}
        return state, meta.get("drafter", {}) if isinstance(meta, dict) else {}
    data = torch_load_checked(ckpt)
    if not isinstance(data, dict) or "state_dict" not in data:
        raise CheckpointError(f"checkpoint {path}: holds no state_dict: not a Lightning checkpoint")
    return data["state_dict"], data.get("drafter", {})


def sub_state_dict(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under ``prefix`` with the prefix removed; an error when there are none."""
    out = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if not out:
        raise KeyError(f"no weights under {prefix!r} in the checkpoint (keys start with {sorted(state)[:3]}...)")
    return out
