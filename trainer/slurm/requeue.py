"""The requeue loop of a ``draftsmith slurm submit`` job: each attempt's log lines, and whether a failed one requeues.

The rendered sbatch script (slurm/train.sbatch.in) runs ``python -m trainer.slurm.requeue start`` before its ``srun ...
fit ... --ckpt_path last`` and ``python -m trainer.slurm.requeue end --exit_status N`` after it:

- ``start`` logs ``attempt N of job J: resuming from step S (PATH)`` (or ``starting from scratch``) and records the
  step in the job's state file (``<log_dir>/<job_name>-<job id>.requeue.json``, which survives a requeue);
- ``end`` logs the fit's exit status and the step of the last complete checkpoint now. A fit that exited 0 ends the
  job, and so does one that exited 2, an error in its input (a recipe key, a path, the data; ``draftsmith`` printed
  it), which a requeue would meet again. A fit that failed otherwise (a task killed, a node lost: ``srun
  --kill-on-bad-exit=1`` ends the whole step when one task dies) requeues the job with ``scontrol requeue``, unless
  it is the ``max_failed_requeues + 1``-th failure in a row that made no progress (the last complete checkpoint's
  step is the one it resumed from): then it stops, saying why, and the job ends with the fit's status instead of
  burning its allocation on the same failure.

"The last complete checkpoint" is the one ``--ckpt_path last`` resumes: the newest ``last*.ckpt`` of the recipe's
ModelCheckpoint folders, leaving out sharded folders without their marker (trainer/checkpoints/sharded.py). Its step
is the file's ``global_step``, or the marker's ``step`` for a sharded folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from trainer.checkpoints.sharded import read_marker
from trainer.interface.errors import USER_ERROR_STATUS

log = logging.getLogger("trainer.slurm.requeue")  # also when run as __main__

_LAST = re.compile(r"^last(-v?\d+)?\.ckpt$")  # ModelCheckpoint's CHECKPOINT_NAME_LAST, versioned or not


def last_checkpoint(folders: list[Path]) -> tuple[Path, int] | None:
    """The checkpoint ``--ckpt_path last`` resumes from and its step, or None when the folders hold none.

    Args:
        folders: the ModelCheckpoint folders of the recipe.
    """
    found: list[tuple[float, Path, int]] = []
    for folder in folders:
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            if not _LAST.match(path.name):
                continue
            step = checkpoint_step(path)
            if step is not None:
                found.append((path.stat().st_mtime, path, step))
    if not found:
        return None
    _, path, step = max(found, key=lambda item: item[0])
    return path, step


def checkpoint_step(path: Path) -> int | None:
    """The global step of a complete checkpoint (a file's ``global_step``, a sharded folder's marker), else None.

    Args:
        path: a checkpoint file or folder.
    """
    if path.is_dir():
        marker = read_marker(path)
        step = marker.get("step") if marker is not None else None
        return step if isinstance(step, int) else None
    from trainer.checkpoints.reading import torch_load_checked

    try:
        step = torch_load_checked(path).get("global_step")
    except Exception as err:  # a file that is not a whole checkpoint resumes nothing
        log.warning("requeue: cannot read the step of %s: %s", path, err)
        return None
    return step if isinstance(step, int) else None


def _describe(found: tuple[Path, int] | None) -> str:
    return "no checkpoint" if found is None else f"step {found[1]} ({found[0]})"


def _read_state(path: Path) -> dict:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _write_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def start(state_file: Path, folders: list[Path], job_id: str, attempt: int) -> None:
    """Logs what the attempt resumes from and records its step in ``state_file``.

    Args:
        state_file: the job's state file (kept across requeues).
        folders: the recipe's ModelCheckpoint folders.
        job_id: the SLURM job id, for the log line.
        attempt: this attempt's number, from 1 (``SLURM_RESTART_COUNT`` + 1).
    """
    found = last_checkpoint(folders)
    state = _read_state(state_file)
    step = None if found is None else found[1]
    previous = state.get("resumed_from")
    if step is not None and (previous is None or step > previous):
        state["failures_without_progress"] = 0  # e.g. after a requeue on USR1, which saved the step it reached
    state.update(attempt=attempt, resumed_from=step)
    _write_state(state_file, state)
    if found is None:
        log.info("attempt %d of job %s: starting from scratch (no checkpoint yet)", attempt, job_id)
    else:
        log.info("attempt %d of job %s: resuming from step %d (%s)", attempt, job_id, found[1], found[0])


def end(state_file: Path, folders: list[Path], job_id: str, exit_status: int, max_failed_requeues: int) -> int:
    """Logs how the attempt ended and requeues the job after a failure that may still get somewhere.

    Args:
        state_file: the job's state file (what :func:`start` recorded, and the failures in a row without progress).
        folders: the recipe's ModelCheckpoint folders.
        job_id: the SLURM job to requeue.
        exit_status: the exit status of ``srun ... fit``.
        max_failed_requeues: requeues in a row after failed attempts that made no progress; the next such failure
            stops the job.

    Returns:
        The batch script's exit status: 0 when the fit finished or the job was requeued, else ``exit_status``.
    """
    state = _read_state(state_file)
    attempt = int(state.get("attempt", 1))
    before = state.get("resumed_from")
    found = last_checkpoint(folders)
    after = None if found is None else found[1]
    if exit_status == 0:
        log.info(
            "attempt %d of job %s: the fit ended with exit status 0; last checkpoint: %s",
            attempt,
            job_id,
            _describe(found),
        )
        return 0
    if exit_status == USER_ERROR_STATUS:
        log.error(
            "attempt %d of job %s: the fit ended with exit status %d, an error in its input that it printed above "
            "(a recipe key, a path, the data); last checkpoint: %s; stopping: a requeue would meet the same error",
            attempt,
            job_id,
            exit_status,
            _describe(found),
        )
        return exit_status
    progress = after is not None and (before is None or after > before)
    failures = 0 if progress else int(state.get("failures_without_progress", 0)) + 1
    state.update(failures_without_progress=failures)
    _write_state(state_file, state)
    since = "from scratch" if before is None else f"from step {before}"
    what = (
        f"attempt {attempt} of job {job_id}: the fit failed with exit status {exit_status}; last checkpoint: "
        f"{_describe(found)}, {'progress' if progress else 'no progress'} since it started {since}"
    )
    if failures > max_failed_requeues:
        log.error(
            "%s; stopping: %d failed attempts in a row made no progress (slurm max_failed_requeues %d)",
            what,
            failures,
            max_failed_requeues,
        )
        return exit_status
    left = max_failed_requeues - failures
    log.warning("%s; requeueing (%d more failure(s) without progress allowed)", what, left)
    for handler in logging.getLogger().handlers:  # scontrol requeue ends this script: what was logged goes out first
        try:
            handler.flush()
        except (OSError, ValueError):  # a handler whose stream is already closed has nothing left to write
            pass
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        log.error("attempt %d of job %s: scontrol requeue failed: %s", attempt, job_id, proc.stderr.strip())
        return exit_status
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m trainer.slurm.requeue {start,end}`` (run by the rendered sbatch script)."""
    p = argparse.ArgumentParser(prog="python -m trainer.slurm.requeue", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("action", choices=("start", "end"), help="before the fit (start) or after it (end)")
    p.add_argument("--state", type=Path, required=True, help="the job's state file, kept across requeues")
    p.add_argument("--checkpoints", type=Path, action="append", required=True, help="a ModelCheckpoint folder")
    p.add_argument(
        "--max_failed_requeues", type=int, default=3, help="requeues in a row after failures without progress"
    )
    p.add_argument("--exit_status", type=int, default=0, help="end: the exit status of srun ... fit")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m trainer.slurm.requeue``; returns the batch script's exit status."""
    from trainer.interface.output import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging(debug=False)
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if args.action == "start":
        attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) + 1
        start(args.state, args.checkpoints, job_id, attempt)
        return 0
    return end(args.state, args.checkpoints, job_id, args.exit_status, args.max_failed_requeues)


if __name__ == "__main__":
    sys.exit(main())
