"""Step time and peak memory per rank of DeepSpeed ZeRO 1, 2 and 3 against DDP, 2 CPU processes, side by side; then
the memory planner's table for 8B and 70B Llama targets on 8 GPUs of 80 GB. Prints markdown for the README.

Each strategy trains the same toy Llama (tests/integration/_toy_fit.py, Adam) for a few steps with the project's
``recipes/_base`` fragment, in 2 processes (gloo). Every rank reports its median step time after warm-up and the rise
of its peak resident set size during training over the RSS it had at the start of training (the model, the
strategy's buffers and the optimizer created). Ratios are to DDP.

    python -m bench.bench_zero [--steps 30] [--hidden 512] [--layers 4] [--vocab 16384]
    python -m bench.bench_zero --plan-only      # just the planner's table

The first DeepSpeed run on a machine compiles DeepSpeed's CPU collective (about a minute); set TORCH_EXTENSIONS_DIR
(the Makefile does) to keep it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L

from bench.common import ROOT

STRATEGIES = {
    "ddp": "ddp.yaml",
    "zero1": "deepspeed_zero1.yaml",
    "zero2": "deepspeed_zero2.yaml",
    "zero3": "deepspeed_zero3.yaml",
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Measure(L.Callback):
    """Per rank: step times and the peak RSS rise during training, written to ``<out>.<rank>.json``."""

    def __init__(self, out: str, warmup: int = 3) -> None:
        """Args: out: path prefix of the per-rank JSON files; warmup: steps left out of the median."""
        self.out = out
        self.warmup = warmup
        self.times: list[float] = []
        self._t0 = 0.0
        self._rss0 = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self._rss0 = _rss_mib()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.times.append(time.perf_counter() - self._t0)

    def on_train_end(self, trainer, pl_module) -> None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
        record = {
            "step_s": statistics.median(self.times[self.warmup :] or self.times),
            "rss_start_mib": self._rss0,
            "peak_rise_mib": max(peak - self._rss0, 0.0),
            "peak_mib": peak,
        }
        Path(f"{self.out}.{trainer.global_rank}.json").write_text(json.dumps(record))


def run_strategy(name: str, args: argparse.Namespace, work: Path) -> list[dict]:
    out = work / name
    cmd = [sys.executable, str(ROOT / "tests/integration/_toy_fit.py"), "fit"]
    cmd += ["--config", str(ROOT / "recipes/_base" / STRATEGIES[name])]
    cmd += ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.max_steps", str(args.steps)]
    cmd += ["--trainer.enable_checkpointing", "false", "--trainer.logger", "false"]
    cmd += ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    cmd += ["--trainer.default_root_dir", str(out)]
    cmd += ["--model.vocab_size", str(args.vocab), "--model.hidden_size", str(args.hidden)]
    cmd += ["--model.num_layers", str(args.layers), "--data.vocab_size", str(args.vocab)]
    cmd += ["--data.seq_len", str(args.seq), "--data.batch_size", str(args.batch)]
    cmd += ["--data.num_samples", str(2 * args.batch * (args.steps + 2))]
    cmd += ["--trainer.callbacks+=bench.bench_zero.Measure", "--trainer.callbacks.out", str(out)]
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    # the run's folder is its working directory: the repository root is where its callback's package is found
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=work)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(2)]


def measured_table(args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run_strategy(name, args, Path(tmp)) for name in STRATEGIES}
    base = results["ddp"]
    base_time = statistics.mean(r["step_s"] for r in base)
    base_rise = statistics.mean(r["peak_rise_mib"] for r in base)
    base_peak = statistics.mean(r["peak_mib"] for r in base)
    params = _toy_parameters(args)
    rows = [
        f"Toy Llama {params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), "
        f"Adam fp32, batch {args.batch} x seq {args.seq} per rank, 2 CPU processes (gloo), {args.steps} steps; "
        "per rank: median step time, peak RSS, rise of the peak RSS during training.",
        "",
        "| strategy | step s (rank 0 / 1) | step time / DDP | peak MiB (rank 0 / 1) | peak / DDP | rise MiB | "
        "rise / DDP |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, ranks in results.items():
        t = statistics.mean(r["step_s"] for r in ranks)
        rise = statistics.mean(r["peak_rise_mib"] for r in ranks)
        peak = statistics.mean(r["peak_mib"] for r in ranks)
        rows.append(
            f"| {name} | {ranks[0]['step_s']:.3f} / {ranks[1]['step_s']:.3f} | {t / base_time:.2f} | "
            f"{ranks[0]['peak_mib']:.0f} / {ranks[1]['peak_mib']:.0f} | {peak / base_peak:.2f} | {rise:.0f} | "
            f"{rise / base_rise:.2f} |"
            if base_rise > 0
            else f"| {name} | {ranks[0]['step_s']:.3f} / {ranks[1]['step_s']:.3f} | {t / base_time:.2f} | "
            f"{ranks[0]['peak_mib']:.0f} / {ranks[1]['peak_mib']:.0f} | {peak / base_peak:.2f} | {rise:.0f} | - |"
        )
    return "\n".join(rows)


def _toy_parameters(args: argparse.Namespace) -> int:
    from trainer.planner import Shape

    shape = Shape(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
    )
    return shape.parameters()


def planner_tables(gpus: int = 8, gpu_memory: str = "80GB", reserve: str = "3GB") -> str:
    from trainer.planner import PRESETS, Shape, estimate, markdown_table, parse_bytes

    budget = parse_bytes(gpu_memory) - parse_bytes(reserve)
    out = []
    for name, batch, seq in (("llama-3-8b", 4, 4096), ("llama-3-70b", 1, 4096)):
        target = Shape.from_config(PRESETS[name])
        drafter = dataclasses.replace(target, num_hidden_layers=2)  # a 2-layer draft model of the target's width
        estimates = estimate(target, drafter, batch=batch, seq=seq, gpus=gpus, precision="bf16-mixed")
        out.append(
            f"**{name}** target ({target.parameters() / 1e9:.2f}B), 2-layer drafter of its width "
            f"({drafter.parameters() / 1e9:.2f}B), bf16-mixed, batch {batch} x seq {seq} per GPU, {gpus} GPUs of "
            f"{gpu_memory} ({reserve} reserved):\n\n{markdown_table(estimates, budget)}\n"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per strategy run")
    p.add_argument("--plan-only", action="store_true", help="print only the planner's tables")
    args = p.parse_args()
    if not args.plan_only:
        print("### ZeRO on CPU, 2 processes (ratios to DDP)\n")
        print(measured_table(args))
        print()
    print("### Planner: bytes per GPU\n")
    print(planner_tables())


if __name__ == "__main__":
    main()
