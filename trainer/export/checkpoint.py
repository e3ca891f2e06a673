"""Reads a training checkpoint into a plain state dict, whatever strategy wrote it.

A Lightning checkpoint file is read with ``torch.load(weights_only=True)``; a DeepSpeed checkpoint directory is
consolidated to full float32 tensors first. Objectives record in the checkpoint what the drafter is
(``checkpoint["drafter"]``: its kind, config and the state-dict prefix of its weights), so exporters never need to
load the target to rebuild it.
"""

from __future__ import annotations

from pathlib import Path

import torch


def load_training_checkpoint(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Returns (state_dict, drafter record) of a ``.ckpt`` file or a DeepSpeed checkpoint directory."""
    ckpt = Path(path)
    if not ckpt.exists():
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if ckpt.is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # ZeRO-1/2 write mp_rank_00_model_states.pt, ZeRO-3 one zero_pp_rank_R_mp_rank_00_model_states.pt per rank;
        # rank 0's holds Lightning's client state, the drafter record among it
        candidates = [
            ckpt / "checkpoint" / n for n in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
        ]
        client_state = next((c for c in candidates if c.is_file()), None)
        if client_state is None:
            raise FileNotFoundError(f"{path!r} is a directory but not a DeepSpeed checkpoint (no {candidates[0].name})")
        meta = torch.load(client_state, map_location="cpu", weights_only=True)
        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
        state = {k.removeprefix("_forward_module."): v for k, v in state.items()}
        return state, meta.get("drafter", {})
    data = torch.load(ckpt, map_location="cpu", weights_only=True)
    if "state_dict" not in data:
        raise ValueError(f"{path!r} holds no state_dict: not a Lightning checkpoint")
    return data["state_dict"], data.get("drafter", {})


def sub_state_dict(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under ``prefix`` with the prefix removed; an error when there are none."""
    out = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if not out:
        raise KeyError(f"no weights under {prefix!r} in the checkpoint (keys start with {sorted(state)[:3]}...)")
    return out
