"""trainer/slurm/requeue.py, the requeue loop of a SLURM job, without SLURM: ``scontrol requeue`` is recorded instead of
run.

Each attempt's ``start`` and ``end`` run on a checkpoint folder that the test writes as a fit would; the decisions
(requeue or stop, the exit status) are those of a plain loop over the attempts' steps.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch

from trainer.checkpoints.sharded import MARKER
from trainer.slurm import requeue


def _save(folder: Path, step: int, name: str = "last.ckpt") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "state_dict": {"w": torch.zeros(2)}}, folder / name)
    return folder / name


@pytest.fixture
def requeued(monkeypatch) -> list[list[str]]:
    """The ``scontrol requeue`` commands the loop ran."""
    calls: list[list[str]] = []

    def run(cmd, **kwargs):
        calls.append(list(cmd))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(requeue.subprocess, "run", run)
    return calls


def test_the_step_is_that_of_the_checkpoint_ckpt_path_last_resumes(tmp_path):
    folder = tmp_path / "ckpt"
    assert requeue.last_checkpoint([folder]) is None  # no folder yet
    old = _save(folder, 5)
    _save(folder, 10, "step=10.ckpt")  # not a last checkpoint
    assert requeue.last_checkpoint([folder]) == (old, 5)
    sharded = folder / "last-v1.ckpt"
    sharded.mkdir()  # a DeepSpeed folder without its marker: not complete, left out
    assert requeue.last_checkpoint([folder]) == (old, 5)
    (sharded / MARKER).write_text(json.dumps({"step": 7, "world_size": 2}))
    os.utime(old, (1, 1))  # the folder is the newest last checkpoint, as Lightning compares them
    assert requeue.last_checkpoint([folder]) == (sharded, 7)


def _naive(attempts: list[tuple[int, int | None]], limit: int) -> list[str]:
    """What each attempt should lead to: ``done``, ``requeue`` or ``stop``; attempts are (exit status, step of the
    last checkpoint when it ended), the job starting with no checkpoint."""
    out: list[str] = []
    before: int | None = None
    stalled = 0
    for status, after in attempts:
        if status == 0:
            out.append("done")
            break
        if status == 2:  # an error in the fit's input: the same on every attempt
            out.append("stop")
            break
        moved = after is not None and (before is None or after > before)
        stalled = 0 if moved else stalled + 1
        if stalled > limit:
            out.append("stop")
            break
        out.append("requeue")
        before = after
    return out


@pytest.mark.parametrize(
    "attempts, limit",
    [
        ([(137, 5), (137, 5), (137, 5), (137, 5), (137, 5)], 3),  # stuck at step 5 after the first attempt
        ([(137, 5), (137, 5), (137, 5)], 1),
        ([(1, None), (1, None)], 0),  # fails before its first checkpoint, no requeue allowed without progress
        ([(137, 5), (137, 5), (137, 10), (137, 10), (0, 12)], 1),  # progress resets the count
        ([(137, 5), (0, 12)], 3),
        ([(137, 5), (2, 5)], 3),  # a recipe error after a requeue (say, an edited recipe): no requeue
        ([(2, None)], 3),
    ],
)
def test_a_failure_without_progress_stops_after_the_limit(tmp_path, requeued, caplog, attempts, limit):
    folder, state = tmp_path / "ckpt", tmp_path / "logs" / "job-12.requeue.json"
    expected = _naive(attempts, limit)
    got: list[str] = []
    caplog.set_level(logging.INFO, logger="trainer.slurm.requeue")
    for n, (status, after) in enumerate(attempts[: len(expected)], start=1):
        caplog.clear()
        requeue.start(state, [folder], "12", n)
        began = caplog.messages[-1]
        if after is not None:
            _save(folder, after)
        calls = len(requeued)
        result = requeue.end(state, [folder], "12", status, limit)
        ended = caplog.messages[-1]
        assert began.startswith(f"attempt {n} of job 12: ")
        assert ended.startswith(f"attempt {n} of job 12: ")
        assert f"exit status {status}" in ended
        if status == 0:
            got.append("done")
            assert result == 0 and len(requeued) == calls
        elif len(requeued) > calls:
            got.append("requeue")
            assert result == 0 and requeued[-1] == ["scontrol", "requeue", "12"] and "; requeueing" in ended
        else:
            got.append("stop")
            why = "a requeue would meet the same error" if status == 2 else f"(slurm max_failed_requeues {limit})"
            assert result == status and why in ended
    assert got == expected


def test_an_attempt_logs_what_it_resumed_from(tmp_path, requeued, caplog):
    folder, state = tmp_path / "ckpt", tmp_path / "job.requeue.json"
    caplog.set_level(logging.INFO, logger="trainer.slurm.requeue")
    requeue.start(state, [folder], "7", 1)
    assert caplog.messages[-1] == "attempt 1 of job 7: starting from scratch (no checkpoint yet)"
    path = _save(folder, 5)
    assert requeue.end(state, [folder], "7", 137, 3) == 0
    assert caplog.messages[-1] == (
        f"attempt 1 of job 7: the fit failed with exit status 137; last checkpoint: step 5 ({path}), progress since "
        "it started from scratch; requeueing (3 more failure(s) without progress allowed)"
    )
    requeue.start(state, [folder], "7", 2)
    assert caplog.messages[-1] == f"attempt 2 of job 7: resuming from step 5 ({path})"


def test_a_closed_log_stream_does_not_stop_the_requeue(tmp_path, requeued):
    """A root handler whose stream is already closed (the flush before scontrol raised ValueError) still requeues."""
    import io

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    stream.close()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        folder, state = tmp_path / "ckpt", tmp_path / "logs" / "job-12.requeue.json"
        requeue.start(state, [folder], "12", 1)
        _save(folder, 5)
        assert requeue.end(state, [folder], "12", 1, 3) == 0
        assert len(requeued) == 1
    finally:
        root.removeHandler(handler)
