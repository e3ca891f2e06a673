"""Callbacks that tests name in recipes' trainer.callbacks (by class_path) to observe or interrupt a run."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import lightning as L


class RecordBatches(L.Callback):
    """Appends one line per training batch to ``path``: the global step, the rank, a hash of the batch's input ids,
    one hash per row, and with document masking the number of documents in each row."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        ids = batch["input_ids"].cpu().numpy()
        digest = hashlib.sha256(ids.tobytes()).hexdigest()[:16]
        rows = [hashlib.sha256(row.tobytes()).hexdigest()[:16] for row in ids]
        record = {"step": trainer.global_step, "rank": trainer.global_rank, "batch": digest, "rows": rows}
        if "document_ids" in batch:  # packed rows with document masking: the documents in each row
            record["documents"] = [int(row.max()) + 1 for row in batch["document_ids"]]
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


class StopAtStep(L.Callback):
    """Ends fit cleanly after ``step`` optimizer steps, as a preempted job would, leaving max_steps (and so the
    learning-rate schedule) as in the uninterrupted run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class RecordGradNorm(L.Callback):
    """Appends one line per optimizer step to ``path``: the global step, the rank and the L2 norm of the trained
    parameters' gradients as the optimizer receives them (after the ranks' reduction; strategies that keep gradients
    in their own buffers, as DeepSpeed ZeRO, leave ``.grad`` empty: nothing is written)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        import torch

        grads = [p.grad.detach().double().norm() for p in pl_module.parameters() if p.grad is not None]
        if grads:
            record = {
                "step": trainer.global_step,
                "rank": trainer.global_rank,
                "norm": float(torch.stack(grads).norm()),
            }
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
