"""A callback that records, per rank, what the strategy tests check: losses, step counts and full weights.

Add it to any `fit` command line (the toy runner or the project CLI)::

    --trainer.callbacks+=tests.integration._probe.StateProbe --trainer.callbacks.out_dir DIR

Each rank r writes ``DIR/rank{r}.json`` (start and end global step, per-step losses) and the full, gathered
weights of the LightningModule at the start and the end of fit as ``DIR/{start,end}_rank{r}.safetensors``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from safetensors.torch import save_file

from trainer.distributed.strategies import full_state_dict


class StateProbe(Callback):
    """Writes per-rank losses, steps and full weights for the tests to compare."""

    def __init__(self, out_dir: str = "probe") -> None:
        """Create the probe.

        Args:
            out_dir: folder for the per-rank records.
        """
        self.out_dir = Path(out_dir)
        self.losses: list[float] = []
        self.start_step = -1

    def _save_weights(self, trainer: Trainer, pl_module: LightningModule, tag: str) -> None:
        state = full_state_dict(pl_module)  # collective: every rank calls it
        tensors = {k: v.float().contiguous() for k, v in state.items() if torch.is_floating_point(v)}
        save_file(tensors, str(self.out_dir / f"{tag}_rank{trainer.global_rank}.safetensors"))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.start_step = trainer.global_step
        self._save_weights(trainer, pl_module, "start")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save_weights(trainer, pl_module, "end")
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "start_step": self.start_step,
            "end_step": trainer.global_step,
            "losses": self.losses,
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
