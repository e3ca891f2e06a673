"""The heads' memory-saving backwards in two processes: under DDP and DeepSpeed ZeRO-2 the sequential backward, under
ZeRO-3 and FSDP2 (sharded weights) the per-head checkpointed one, each against the naive backward (every head's
logits alive), with and without gradient accumulation (2 micro-batches): the gradients the strategy hands the
optimizer agree.

This file is also the worker, run in 2 processes (torchrun style) that fit, one strategy after the other,
``ParallelMTPHeads`` for one step of SGD at learning rate 1000 per backward and accumulation: the weights' change is
-1000 times the gradient the optimizer received (DeepSpeed keeps gradients in its own partitions, out of reach of
``p.grad``; the large step dwarfs the weights' float32 rounding). Under DDP the model is float64 (precision
64-true): float64 agreement. DeepSpeed keeps float32 master weights and gradient partitions whatever the model's dtype
(and FSDP2 runs float32 here), so there the model is float32 and the agreement float32's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
VOCAB, SEQ, ROWS = 40, 10, 16
LR = 1000.0


def _data_module():
    """Fixed random rows (the sampler gives each rank its own), labels with an untrained prompt."""
    import lightning as L
    from torch.utils.data import DataLoader

    class Rows(L.LightningDataModule):
        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)  # [R, S + 1]
            labels = ids[:, 1:].clone()
            labels[::3, :3] = -100
            rows = [{"input_ids": x[:-1], "labels": y, "loss_mask": y != -100} for x, y in zip(ids, labels)]
            return DataLoader(rows, batch_size=2, shuffle=False)

    return Rows()


def _worker(model_dir: str, out_dir: str) -> None:
    """Every strategy in the same processes, one after the other (most of the time is start-up)."""
    for strategy in ("ddp", "zero2", "zero3", "fsdp"):
        _fits(model_dir, Path(out_dir) / strategy, strategy)


def _fits(model_dir: str, out_dir: Path, strategy_name: str) -> None:
    import lightning as L

    from trainer.distributed.strategies import CPUDeepSpeedStrategy, FSDP2Strategy, full_state_dict
    from trainer.methods.mtp_heads.objective import ParallelMTPHeads

    class SGDHeads(ParallelMTPHeads):
        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR)

    class Update(L.Callback):
        """Minus the change of every weight over the run over the learning rate: the gradient of its one SGD step."""

        def __init__(self, path: Path) -> None:
            self.path, self.start = path, {}

        @staticmethod
        def weights(pl_module) -> dict[str, torch.Tensor]:
            names = {n for n, _ in pl_module.mtp.named_parameters()}  # full_state_dict: collective when sharded
            return {n: w for n, w in full_state_dict(pl_module.mtp).items() if n in names}

        def on_train_start(self, trainer, pl_module) -> None:
            self.start = self.weights(pl_module)

        def on_train_end(self, trainer, pl_module) -> None:
            end = self.weights(pl_module)
            if trainer.is_global_zero:
                torch.save({n: (w - end[n]) / LR for n, w in self.start.items()}, self.path)

    ddp = strategy_name == "ddp"
    out_dir.mkdir(parents=True, exist_ok=True)
    strategies = {"ddp": lambda: "ddp", "zero2": lambda: CPUDeepSpeedStrategy(stage=2),
                  "zero3": lambda: CPUDeepSpeedStrategy(stage=3), "fsdp": FSDP2Strategy}  # fmt: skip
    sharded = strategy_name in ("zero3", "fsdp")
    for backward in ("checkpoint" if sharded else "sequential", "naive"):
        for accumulate in (1, 2):
            objective = SGDHeads(
                target=model_dir, num_heads=3, target_dtype="float64" if ddp else "float32", head_backward=backward,
                loss_chunk_size=4, head_weights=[1.0, 0.5, 0.25],
            )  # fmt: skip
            trainer = L.Trainer(
                accelerator="cpu", devices=2, strategy=strategies[strategy_name](), max_steps=1,
                accumulate_grad_batches=accumulate, precision="64-true" if ddp else "32-true", logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                limit_val_batches=0, num_sanity_val_steps=0,
                callbacks=[Update(out_dir / f"{backward}_{accumulate}.pt")],
            )  # fmt: skip
            trainer.fit(objective, _data_module())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sequential_gradients_equal_naive_ones_in_two_processes(tmp_path, torch_extensions_dir) -> None:
    from tests._multiproc import run_group
    from tests.helpers import tiny_llama

    tiny_llama(0, vocab=VOCAB, hidden=32, layers=3).save_pretrained(tmp_path / "model")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, str(tmp_path / "model"), str(tmp_path)]
    res = run_group(cmd, timeout=400, log_dir=tmp_path / "logs", nprocs=2, env=env, rank_env=True, cwd=str(REPO))
    assert res.ok, f"2-process run failed (timed out: {res.timed_out}, exit {res.returncodes}):\n{res.output[-6000:]}"
    for strategy, dtype, tolerance in (("ddp", torch.float64, 1e-12), ("zero2", torch.float32, 1e-5)):
        check_run(tmp_path / strategy, "sequential", strategy, dtype, tolerance)
    for strategy in ("zero3", "fsdp"):
        check_run(tmp_path / strategy, "checkpoint", strategy, torch.float32, 1e-5)


def check_run(run: Path, backward: str, strategy: str, dtype: torch.dtype, tolerance: float) -> None:
    """``backward``'s and the naive updates agree with and without accumulation; accumulation counted both
    micro-batches."""
    for accumulate in (1, 2):
        naive = torch.load(run / f"naive_{accumulate}.pt", weights_only=True)
        sequential = torch.load(run / f"{backward}_{accumulate}.pt", weights_only=True)
        assert naive.keys() == sequential.keys() and len(naive) > 20
        for name in naive:
            assert naive[name].dtype == dtype and naive[name].abs().max() > 0, name  # every weight trained
            scale = float(naive[name].abs().max())
            torch.testing.assert_close(sequential[name], naive[name], rtol=tolerance, atol=tolerance * scale,
                                       msg=f"{strategy}, accumulate {accumulate}: {name}")  # fmt: skip
    one = torch.load(run / "naive_1.pt", weights_only=True)
    two = torch.load(run / "naive_2.pt", weights_only=True)
    assert not torch.allclose(one["model.lm_head.weight"], two["model.lm_head.weight"])  # 2 micro-batches counted


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
    from tests._multiproc import end_worker

    end_worker()  # not the interpreter's teardown, where gloo's threads can abort a finished rank
