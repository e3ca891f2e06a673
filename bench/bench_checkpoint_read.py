"""What reading a training checkpoint for its drafter costs: the whole file read into memory (``torch.load``, as
``draftsmith export`` and ``eval`` read a ``.ckpt`` before) against the file memory-mapped
(``trainer.checkpoints.reading.load_training_checkpoint`` now), each followed by what an export does with it: every
tensor of the drafter's weights read once.

    python -m bench.bench_checkpoint_read --ckpt RUN/checkpoints/last.ckpt [--repeats 3]

A real-width checkpoint shows the difference (the drafter's weights are a third of an AdamW checkpoint, the moments
the rest); the rehearsal keeps one: ``DRAFTSMITH_REHEARSAL_KEEP=1 pytest tests/rehearsal/test_rehearsal.py -k
dflash_llama31_8b_ci`` leaves ``.cache/rehearsal/runs/dflash_llama31_8b_ci/checkpoints/last.ckpt`` (2.8 GB). Each
read runs in its own process (wall seconds and peak resident memory of that process), the two alternated
``--repeats`` times after one unmeasured read that brings the file into the page cache. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import ROOT

READ = """
import json, resource, sys, time
import torch
from trainer.checkpoints.reading import load_training_checkpoint
from trainer.training.registry import DrafterRecord
started = time.perf_counter()
if sys.argv[2] == "whole":
    data = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
    state, raw = data["state_dict"], data.get("drafter", {})
else:
    state, raw = load_training_checkpoint(sys.argv[1])
record = DrafterRecord.from_dict(raw, sys.argv[1])
prefixes = tuple(record.components.values())
total = sum(float(v.float().sum()) for k, v in state.items() if k.startswith(prefixes))
seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def read(ckpt: Path, mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", READ, str(ckpt), mode], capture_output=True, text=True, cwd=ROOT, check=False
    )
    if proc.returncode != 0:
        sys.exit(f"reading {ckpt} ({mode}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, help="a Lightning .ckpt file draftsmith fit wrote")
    parser.add_argument("--repeats", type=int, default=3, help="measured reads of each kind, alternated")
    args = parser.parse_args()
    ckpt = Path(args.ckpt)
    if not ckpt.is_file():
        sys.exit(f"--ckpt {ckpt}: no such file (a .ckpt file; DeepSpeed and FSDP2 folders are read differently)")
    read(ckpt, "whole")  # the page cache, for both
    runs: dict[str, list[dict]] = {"whole": [], "mapped": []}
    for _ in range(args.repeats):
        for mode in runs:
            runs[mode].append(read(ckpt, mode))
    size = ckpt.stat().st_size / 2**30
    rows = [
        f"`{ckpt.name}`, {size:.2f} GiB; median of {args.repeats} reads each, alternated, one process each.",
        "",
        "| read | seconds (median) | peak resident GiB (median) |",
        "|---|---|---|",
    ]
    for mode, label in (("whole", "the whole file (torch.load)"), ("mapped", "memory-mapped (draftsmith now)")):
        seconds = statistics.median(r["seconds"] for r in runs[mode])
        peak = statistics.median(r["peak_gib"] for r in runs[mode])
        rows.append(f"| {label} | {seconds:.2f} | {peak:.2f} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
