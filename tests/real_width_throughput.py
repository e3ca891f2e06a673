"""Training throughput and peak memory of every objective at real width on CPU, side by side in one run.

    python -m tests.real_width_throughput [--model llama31_8b] [--layers 2] [--seq 128] [--steps 2] \
        [--warmup 1] [--objectives kd,on_policy,eagle3,peagle,dflash,dspark,medusa1,mtp]

Builds a real-shape cut target (tests/real_shapes.py: the published config of ``--model`` cut to ``--layers`` layers,
random weights, the real vocabulary) and trains each objective on it, one after the other in this process, through
the runner the GPU suite uses (tests/real_width.py, profile ``cpu``: the recipes' settings with DFlash at one draft
layer and 32 anchors, one Medusa head), in float32 (bf16 matmuls are some 30 times slower on these CPUs) on one
thread. Reports tokens/s and its ratio to KD, seconds per step, the peak resident set of the measured steps and the
trainable parameters, as a markdown table printed and written to ``--out`` (with a JSON beside it).

Each objective runs in a process of its own (this module with ``--child``), one at a time, started when the memory
available holds the float32 target and 4 GiB more (``--wait`` minutes at most): the machine is shared. Objectives that
train the whole target (Medusa-2, MTP heads, LayerSkip: 1.5 B parameters and their fp32 Adam states) are left to the
GPU suite; an objective whose gradients and Adam states would not fit the memory available once it is built is
skipped, with both figures in its row.

It lives in tests/, beside the runner and the real-shape targets it shares with the GPU suite (as the rehearsal's
table does), and runs from the repository root.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.real_shapes import build_cut_target
from tests.real_width import (
    OBJECTIVES,
    TRAINS_THE_TARGET,
    Result,
    Settings,
    available_gib,
    markdown_table,
    run_objective,
    skipped,
    write_json,
    write_text_data,
)

ROOT = Path(__file__).resolve().parents[1]

DEFAULT = [name for name in OBJECTIVES if name not in TRAINS_THE_TARGET]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama31_8b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--objectives", default=",".join(DEFAULT))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", default=str(ROOT / ".cache" / "real_width"))
    parser.add_argument("--output_dir", default=str(ROOT / ".cache" / "real_width" / "throughput.md"))
    parser.add_argument("--wait", type=float, default=20.0, help="minutes to wait for memory before each objective")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one objective, its Result as JSON on stdout
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    target = build_cut_target(args.model, work / f"{args.model}_{args.layers}l", args.layers, torch.bfloat16)
    data = write_text_data(work / "text.jsonl", chars=(args.warmup + args.steps + 4) * args.batch * args.seq * 8)
    settings = Settings(
        device="cpu", precision="32-true", target_dtype="float32", seq_len=args.seq, batch_size=args.batch,
        steps=args.steps, warmup=args.warmup, profile="cpu",
    )  # fmt: skip
    if args.child:
        try:
            result = run_objective(
                args.child, target, data, settings, work / "runs", identity_prompts=0, memory_check=True
            )
        except Exception as err:  # a failed row
            result = Result(args.child, "fail", reason=f"{type(err).__name__}: {err}")
        print("RESULT " + json.dumps(result.__dict__), flush=True)
        return
    need = 2 * (target / "model.safetensors").stat().st_size / 2**30 + 4  # the bf16 file read as float32, and 4 GiB
    results: list[Result] = []
    for name in args.objectives.split(","):
        if name in TRAINS_THE_TARGET:
            results.append(skipped(name, "trains the whole target: the GPU suite measures it", settings))
            continue
        deadline = time.time() + 60 * args.wait
        while available_gib() < need and time.time() < deadline:
            time.sleep(10)
        if available_gib() < need:
            results.append(skipped(name, f"{available_gib():.1f} GiB available after {args.wait} min, {need:.1f} "
                                   "needed to start", settings))  # fmt: skip
            continue
        cmd = [sys.executable, "-m", "tests.real_width_throughput", *sys.argv[1:], "--child", name]
        child = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        if lines:
            result = Result(**json.loads(lines[-1][len("RESULT ") :]))
        else:
            tail = (child.stderr.strip().splitlines() or ["no output"])[-1]
            result = Result(name, "fail", reason=f"exit {child.returncode}: {tail[:200]}")
        print(f"{name}: {result.status} {result.reason}", flush=True)
        results.append(result)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    header = (
        f"{datetime.date.today()}, commit {commit.stdout.strip()}, {platform.machine()} CPU, {args.threads} thread(s), "
        f"torch {torch.__version__}: {args.model} cut to {args.layers} layers, float32, batch {args.batch} x "
        f"{args.seq} tokens, {args.warmup} warm-up + {args.steps} measured steps per objective"
    )
    table = markdown_table(results)
    print(header)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + "\n\n" + table + "\n")
    write_json(out.with_suffix(".json"), results, {"header": header, "argv": sys.argv[1:]})
    print(f"written: {out}")


if __name__ == "__main__":
    main()
