"""XPress's training step on the tiny target, timed: forward (target, drafter, every loss term) and backward of
recipes/quickstart/xpress.yaml's objective on one batch of 4 x 256 tokens of the corpus, one thread.

    python -m bench.studies.xpress_step [--steps 10] [--rounds 3] [--before DIR]

With ``--before DIR`` (a checkout of another commit, e.g. ``git worktree add DIR COMMIT``) the step of that checkout's
``trainer`` is timed in the same run, the two taking turns (``--rounds`` times each, ``--steps`` steps a turn after one
warm-up step, each turn its own process with one thread), and the table gives each side's median tokens/s and their
ratio. Needs the demo's artifacts (``make demo``: the corpus and the tiny target) under ``--artifacts``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker(artifacts: Path, steps: int, batch: int, seq: int) -> None:
    """Time ``steps`` steps (after one warm-up) of the ``trainer`` on the path; prints one JSON line."""
    import torch
    import yaml
    from transformers import AutoTokenizer

    from trainer.methods.xpress.objective import XPress

    torch.set_num_threads(1)
    options = yaml.safe_load((ROOT / "recipes/quickstart/xpress.yaml").read_text())["model"]["init_args"]
    options = {k: v for k, v in options.items() if k != "optim"}
    options["target"] = str(artifacts / "tiny_target")
    objective = XPress(**options)
    tokenizer = AutoTokenizer.from_pretrained(str(artifacts / "corpus" / "tokenizer"))
    rows = []
    with open(artifacts / "corpus" / "train.jsonl") as f:
        for line in f:
            ids = tokenizer(json.loads(line)["text"])["input_ids"]
            if len(ids) >= seq:
                rows.append(ids[:seq])
            if len(rows) == batch:
                break
    ids = torch.tensor(rows)
    data = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    times = []
    for step in range(steps + 1):
        objective.drafter.zero_grad(set_to_none=True)
        started = time.perf_counter()
        loss, _ = objective.compute_loss(data)
        loss.backward()
        if step:  # the first is the warm-up
            times.append(time.perf_counter() - started)
    print(json.dumps({"seconds": times, "tokens": ids.numel(), "loss": float(loss)}))


def turn(tree: Path, artifacts: Path, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--artifacts", str(artifacts)]
    out = subprocess.run([*command, "--steps", str(steps)], env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifacts", type=Path, default=ROOT / "artifacts")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.artifacts.resolve(), args.steps, 4, 256)
        return
    sides = {"this checkout": ROOT} | ({"--before": args.before.resolve()} if args.before else {})
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    losses = {}
    for _ in range(args.rounds):
        for name, tree in reversed(sides.items()):
            result = turn(tree, args.artifacts.resolve(), args.steps)
            seconds[name] += result["seconds"]
            losses[name], tokens = result["loss"], result["tokens"]
    rate = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    print("| trainer | median step, s | tokens/s | loss of the batch |")
    print("|---|---|---|---|")
    for name in sides:
        print(f"| {name} | {statistics.median(seconds[name]):.3f} | {rate[name]:,.0f} | {losses[name]:.6f} |")
    if args.before:
        print(f"\nratio: {rate['this checkout'] / rate['--before']:.2f}x ({len(seconds['--before'])} steps a side)")


if __name__ == "__main__":
    main()
