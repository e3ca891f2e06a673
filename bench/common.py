"""What the benchmarks and studies share: the repository root, the demo's prompts and held-out batches, ``draftsmith``
runs started side by side with their output in log files, a script's command line for its own child processes, and
the memory one training step holds.

Only the standard library is imported at the top (``bench.bench_vs_speculators`` also runs in speculators' own
virtualenv, which has no draftsmith); what needs torch or draftsmith imports it inside the function.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root, where every script runs from (``python -m bench.<name>``) and where its children start."""

PROMPT_CHARS = 160
"""Characters of a prompt cut from a corpus file, as ``draftsmith prepare``, ``compare`` and the demo cut them
(trainer.data.corpus.PROMPT_CHARS, repeated here: this module imports only the standard library at the top)."""


# ---- draftsmith runs -------------------------------------------------------------------------------------------------


def draftsmith_exe() -> str:
    """The ``draftsmith`` installed beside this Python, else the one on PATH."""
    beside = Path(sys.executable).parent / "draftsmith"
    return str(beside) if beside.is_file() else shutil.which("draftsmith") or str(beside)


def run(cmd: list[str], log: Path, threads: int | None = None, python: Path | None = None) -> subprocess.Popen:
    """Starts ``cmd`` from the repository root with its output in ``log``: a ``draftsmith ...`` command line (its first
    element becomes :func:`draftsmith_exe`), or with ``python`` that interpreter's arguments.

    ``threads`` sets OMP_NUM_THREADS and MKL_NUM_THREADS: one thread each keeps runs that share the machine from
    slowing each other down several times.
    """
    cmd = [str(python), *cmd] if python is not None else [draftsmith_exe(), *cmd[1:]]
    env = dict(os.environ)
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log.parent.mkdir(parents=True, exist_ok=True)
    print("$", " ".join(cmd), f"> {log}", flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait(proc: subprocess.Popen, log: Path) -> None:
    """Waits for ``proc``; when it failed, exits with the last lines of its ``log``."""
    if proc.wait() != 0:
        sys.exit(f"failed (exit {proc.returncode}), see {log}:\n" + "".join(log.read_text().splitlines(True)[-30:]))


def module_command(module: str, *args: str) -> list[str]:
    """This Python running ``module`` as ``python -m`` with ``args``: how a script starts itself in a child process
    (with ``cwd=ROOT``, where the ``bench`` package is found)."""
    return [sys.executable, "-m", module, *args]


def run_dirs(run_dir: Path) -> list[str]:
    """``draftsmith fit`` overrides that keep a run's logs and its last checkpoint (no other) under ``run_dir``."""
    checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(run_dir / "checkpoints"), "save_top_k": 0, "save_last": True},
    }
    return [
        "--trainer.default_root_dir", str(run_dir), "--trainer.logger.init_args.save_dir", str(run_dir),
        "--trainer.callbacks", json.dumps([checkpoint]),
    ]  # fmt: skip


def fit_cmd(
    recipe: str, run_dir: Path, train_file: Path, seconds: int, steps: int | None, extra: list[str]
) -> list[str]:
    """``draftsmith fit`` of ``recipe`` on ``train_file`` for ``steps`` optimizer steps (the recipe's cosine decay), or
    for ``seconds`` of wall-clock time at a constant learning rate after warm-up (a run bounded by time has no step
    count to decay over); no validation."""
    if steps is not None:
        length = ["--trainer.max_steps", str(steps)]
    else:
        hms = time.strftime("%H:%M:%S", time.gmtime(seconds))
        length = [
            "--trainer.max_steps", "-1", "--trainer.max_time", f"00:{hms}",
            "--model.init_args.optim.decay", "constant",
        ]  # fmt: skip
    return [
        "draftsmith", "fit", "--config", recipe, *run_dirs(run_dir), "--trainer.limit_val_batches", "0", *length,
        "--data.init_args.train_files", json.dumps([str(train_file)]), *extra,
    ]  # fmt: skip


# ---- the demo's data -------------------------------------------------------------------------------------------------


def training_prompts(train_file: Path, out: Path, per_file: int, seed: int) -> None:
    """Training prompts of :data:`PROMPT_CHARS` characters cut from ``train_file`` into ``out``, ``per_file`` from each
    file: the cut of ``draftsmith prepare`` and ``draftsmith compare`` (trainer/data/corpus.py)."""
    from trainer.data.corpus import training_prompts as cut_prompts

    cut_prompts(train_file, out, PROMPT_CHARS, per_file, seed)


def heldout_texts(corpus: Path, count: int) -> list[str]:
    """The demo's held-out prompts: the first :data:`PROMPT_CHARS` characters of the first ``count`` held-out files."""
    from trainer.data.corpus import heldout_prompts

    return heldout_prompts(corpus / "heldout.jsonl", count, PROMPT_CHARS)


def write_heldout_prompts(corpus: Path, out: Path, count: int) -> Path:
    """:func:`heldout_texts` as a ``{"prompt": ...}`` jsonl at ``out`` (what ``draftsmith eval --prompts`` reads), as
    ``draftsmith demo`` and ``draftsmith prepare`` write it."""
    from trainer.data.corpus import write_heldout_prompts as write

    return write(corpus / "heldout.jsonl", out, count, PROMPT_CHARS)


def heldout_data(corpus: Path):
    """The demo's held-out batches (8 x 256 tokens of the corpus' held-out files), set up: what the benchmarks'
    held-out losses are measured on, as ``draftsmith demo`` measures them."""
    from trainer.data.text import TextDataModule

    data = TextDataModule(
        tokenizer=str(corpus / "tokenizer"), train_files=[str(corpus / "train.jsonl")],
        val_files=[str(corpus / "heldout.jsonl")], seq_len=256, batch_size=8,
    )  # fmt: skip
    data.setup("fit")
    return data


# ---- memory ----------------------------------------------------------------------------------------------------------


def peak_rss_mib() -> float:
    """This process's peak resident set size so far, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def step_memory(step_forward: Callable[[], object], device) -> tuple[int, int]:
    """(held, peak) bytes of one forward (``step_forward()`` returns the loss) and its backward.

    ``held``: the bytes allocated during the forward and still alive when backward starts (what the step keeps for
    backward); ``peak``: the highest allocation above the start during forward and backward. On CUDA the allocator's
    own counts; on CPU the profiler's, each allocation and free attributed to the op it happens in.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    if device.type == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = step_forward()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - start
        loss.backward()
        torch.cuda.synchronize()
        return held, torch.cuda.max_memory_allocated() - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = step_forward()
        with record_function("bench_backward"):
            loss.backward()
    events = prof.events()
    split = next(e.time_range.start for e in events if e.name == "bench_backward")
    # each allocation and free is attributed to the op it happens in (its self memory), at that op's start
    timeline = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in events if e.self_cpu_memory_usage)
    running, peak, held = 0, 0, 0
    for at, delta in timeline:
        running += delta
        peak = max(peak, running)
        if at < split:
            held = running
    return held, peak
