"""``draftsmith slurm submit`` against a real single-node SLURM cluster that this module starts and stops.

A 2-task CPU job trains the quickstart KD recipe to the end; a second job, sent USR1 mid-training (as SLURM does before
the time limit), checkpoints, requeues itself, resumes with ``--ckpt_path last`` and ends on the same batches and
bitwise the same weights as the uninterrupted job. A job one of whose tasks is killed (SIGKILL, as with its node) is
requeued by the script's loop (trainer/slurm/requeue.py) and ends the same way; a job killed at the same step every time
stops after ``--max_failed_requeues`` requeues without progress, its log saying so at each attempt.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.recipe_runs import RECIPES, ROOT, write_override
from tests.slurm_cluster import FINAL_STATES, kd_job_override, recorded_batches, running_cluster
from trainer.slurm.submit import main as slurm_main

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TASKS = 2
MAX_STEPS = 12
EVERY_N = 5  # periodic checkpoints at steps 5 and 10; the USR1 one at step 7 is none of them
JOB_TIMEOUT = 900  # seconds; generous for a loaded 2-core machine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("slurm"), min_cpus=TASKS, pythonpath=ROOT) as c:
        yield c


def _submit(run: Path, override: dict, name: str, extra: tuple[str, ...] = (), time_limit: str = "00:30:00") -> str:
    """`draftsmith slurm submit` for a 2-task CPU job of the KD recipe; returns the printed job id."""
    run.mkdir(parents=True, exist_ok=True)
    override_file = write_override(run / "override.yaml", override)
    argv = ["submit", "--config", str(RECIPES / "quickstart/kd.yaml"), "--config", str(override_file)]
    argv += ["--nodes", "1", "--gpus_per_node", "0", "--tasks_per_node", str(TASKS), "--time", time_limit]
    argv += ["--job_name", name, "--workdir", str(run), "--output_dir", "logs", *extra]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert slurm_main(argv) == 0
    job_id = out.getvalue().strip()
    assert job_id.isdigit(), job_id
    return job_id


def _job_log(run: Path, name: str, job_id: str) -> str:
    return (run / "logs" / f"{name}-{job_id}.out").read_text(errors="replace")


@pytest.fixture(scope="module")
def uninterrupted(cluster, tiny_corpus, tiny_target, tmp_path_factory):
    run = tmp_path_factory.mktemp("slurm_uninterrupted")
    override = kd_job_override(run, tiny_corpus, tiny_target, MAX_STEPS, EVERY_N, batch_size=2)
    job_id = _submit(run, override, "kd-straight")
    try:
        info = cluster.wait_state(job_id, {"COMPLETED"}, timeout=JOB_TIMEOUT)
    except RuntimeError as err:
        log = run / "logs" / f"kd-straight-{job_id}.out"
        pytest.fail(f"{err}\n{log.read_text()[-4000:] if log.exists() else 'no job log'}")
    return run, job_id, info


def test_submitted_two_task_job_trains_the_kd_recipe(uninterrupted):
    run, job_id, info = uninterrupted
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0" and info["NumTasks"] == str(TASKS)
    script = (run / "logs" / "kd-straight.sbatch").read_text()
    assert f"#SBATCH --ntasks-per-node={TASKS}" in script and "--ckpt_path last" in script
    # two ranks, each on its own half of every global batch, for every step
    batches = recorded_batches(run)
    assert set(batches) == {(step, rank) for step in range(MAX_STEPS) for rank in range(TASKS)}
    assert all(batches[(s, 0)] != batches[(s, 1)] for s in range(MAX_STEPS))
    assert (run / "student" / "model.safetensors").is_file()
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == MAX_STEPS


def test_usr1_checkpoints_requeues_and_resumes_to_the_same_weights(
    cluster, uninterrupted, tiny_corpus, tiny_target, tmp_path
):
    reference, _, _ = uninterrupted
    run = tmp_path / "run"
    run.mkdir()
    wait = {
        "class_path": "tests.slurm_cluster.WaitAtStep",
        "init_args": {"step": 7, "marker": str(run / "waiting"), "release": str(run / "release")},
    }
    override = kd_job_override(run, tiny_corpus, tiny_target, MAX_STEPS, EVERY_N, batch_size=2, extra_callbacks=(wait,))
    job_id = _submit(run, override, "kd-preempted")
    deadline = time.monotonic() + JOB_TIMEOUT
    while not all(Path(f"{run / 'waiting'}.{rank}").exists() for rank in range(TASKS)):
        state = cluster.job_info(job_id).get("JobState")
        log = run / "logs" / f"kd-preempted-{job_id}.out"
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), log.read_text()[-4000:] if log.exists() else state
        assert time.monotonic() < deadline, "the job never reached step 7"
        time.sleep(0.2)
    # both ranks wait at step 7: the time limit is near
    cluster.command(["scancel", "--signal=USR1", job_id])
    time.sleep(1.0)
    (run / "release").touch()
    info = cluster.wait_state(job_id, {"COMPLETED"}, timeout=JOB_TIMEOUT)
    log = _job_log(run, "kd-preempted", job_id)

    assert int(info["Restarts"]) == 1, log[-4000:]
    assert "restart 0 on" in log and "restart 1 on" in log  # --open-mode=append kept the first run's output
    assert "preemption: saved" in log and "requeued SLURM job" in log
    assert "Restoring states from the checkpoint path" in log and "last.ckpt" in log
    # steps 0-6 ran before the requeue, 7-11 after it, on the batches of the uninterrupted job
    assert recorded_batches(run) == recorded_batches(reference)
    a, b = load_file(reference / "student" / "model.safetensors"), load_file(run / "student" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the uninterrupted job"


KILL_AT = 7  # a task killed at the start of step 7: the last complete checkpoint is step 5's


def _kill(run: Path, once: bool) -> dict:
    """Rank 1 killed with SIGKILL at the start of step KILL_AT: in the first run only, or in every run."""
    init_args: dict = {"step": KILL_AT, "rank": 1}
    if once:
        init_args["once"] = str(run / "killed")
    return {"class_path": "tests.slurm_cluster.KillAtStep", "init_args": init_args}


def _attempt_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if re.search(r"attempt \d+ of job", line)]


def test_a_killed_task_is_requeued_and_resumes_to_the_same_weights(
    cluster, uninterrupted, tiny_corpus, tiny_target, tmp_path
):
    reference, _, _ = uninterrupted
    run = tmp_path / "run"
    run.mkdir()
    override = kd_job_override(
        run, tiny_corpus, tiny_target, MAX_STEPS, EVERY_N, batch_size=2, extra_callbacks=(_kill(run, once=True),)
    )
    job_id = _submit(run, override, "kd-killed")
    try:
        info = cluster.wait_state(job_id, {"COMPLETED"}, timeout=JOB_TIMEOUT)
    except RuntimeError as err:
        pytest.fail(f"{err}\n{_job_log(run, 'kd-killed', job_id)[-6000:]}")
    log = _job_log(run, "kd-killed", job_id)

    assert (run / "killed").exists() and int(info["Restarts"]) == 1, log[-4000:]
    lines = _attempt_lines(log)
    assert f"attempt 1 of job {job_id}: starting from scratch" in lines[0]
    failed = lines[1]  # srun ended the step when rank 1 died: the survivor was not left waiting in a collective
    assert f"attempt 1 of job {job_id}: the fit failed with exit status" in failed and "exit status 0" not in failed
    assert f"last checkpoint: step {EVERY_N} (" in failed and "progress since it started from scratch" in failed
    assert "requeueing" in failed
    assert f"attempt 2 of job {job_id}: resuming from step {EVERY_N} (" in lines[2]
    assert (
        f"attempt 2 of job {job_id}: the fit ended with exit status 0; last checkpoint: step {MAX_STEPS} (" in lines[3]
    )
    assert len(lines) == 4
    # steps 0-6 ran before the kill, 5-11 after it (5 and 6 again, on the same batches)
    assert recorded_batches(run) == recorded_batches(reference)
    a, b = load_file(reference / "student" / "model.safetensors"), load_file(run / "student" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the uninterrupted job"


def test_a_job_that_fails_at_the_same_step_stops_after_the_limit(cluster, tiny_corpus, tiny_target, tmp_path):
    limit = 1
    run = tmp_path / "run"
    run.mkdir()
    override = kd_job_override(
        run, tiny_corpus, tiny_target, MAX_STEPS, EVERY_N, batch_size=2, extra_callbacks=(_kill(run, once=False),)
    )
    job_id = _submit(run, override, "kd-failing", extra=("--max_failed_requeues", str(limit)))
    try:
        info = cluster.wait_state(job_id, {"FAILED"}, timeout=JOB_TIMEOUT)
    except RuntimeError as err:
        pytest.fail(f"{err}\n{_job_log(run, 'kd-failing', job_id)[-6000:]}")
    log = _job_log(run, "kd-failing", job_id)

    # the first attempt gets from scratch to step 5, then `limit` requeues resume from step 5 and fail there again
    attempts = 2 + limit
    assert int(info["Restarts"]) == attempts - 1, log[-4000:]
    lines = _attempt_lines(log)
    assert len(lines) == 2 * attempts, "\n".join(lines)
    for n in range(1, attempts + 1):
        began, ended = lines[2 * n - 2], lines[2 * n - 1]
        assert f"attempt {n} of job {job_id}: the fit failed with exit status" in ended
        if n == 1:
            assert "starting from scratch" in began and "progress since it started from scratch" in ended
        else:
            assert f"attempt {n} of job {job_id}: resuming from step {EVERY_N} (" in began
            assert (
                f"last checkpoint: step {EVERY_N} (" in ended
                and f"no progress since it started from step {EVERY_N}" in ended
            )
        if n < attempts:
            assert "requeueing" in ended
    assert (
        f"stopping: {limit + 1} failed attempts in a row made no progress (slurm max_failed_requeues {limit})"
        in lines[-1]
    )
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == EVERY_N


TIME_LIMIT_ENV = "DRAFTSMITH_TEST_TIME_LIMIT"


@pytest.mark.skipif(
    os.environ.get(TIME_LIMIT_ENV) != "1", reason=f"a real time limit takes minutes: set {TIME_LIMIT_ENV}=1"
)
def test_a_job_at_its_time_limit_checkpoints_requeues_and_resumes(
    cluster, uninterrupted, tiny_corpus, tiny_target, tmp_path
):
    """A 3-minute job whose ranks wait at step 7 until slurmctld itself sends USR1, 60 s before the limit
    (``--signal_lead 60``; SLURM may send it up to a minute early): the fit saves, requeues, and the next run ends on
    the batches and weights of the uninterrupted job."""
    reference, _, _ = uninterrupted
    run = tmp_path / "run"
    run.mkdir()
    wait = {"class_path": "tests.slurm_cluster.WaitAtStep", "init_args": {"step": 7, "marker": str(run / "waiting")}}
    override = kd_job_override(run, tiny_corpus, tiny_target, MAX_STEPS, EVERY_N, batch_size=2, extra_callbacks=(wait,))
    job_id = _submit(run, override, "kd-time-limit", ("--signal_lead", "60"), time_limit="00:03:00")
    try:
        info = cluster.wait_state(job_id, {"COMPLETED"}, timeout=JOB_TIMEOUT)
    except RuntimeError as err:
        pytest.fail(f"{err}\n{_job_log(run, 'kd-time-limit', job_id)[-6000:]}")
    log = _job_log(run, "kd-time-limit", job_id)

    assert all(Path(f"{run / 'waiting'}.{rank}").exists() for rank in range(TASKS)), log[-4000:]
    assert int(info["Restarts"]) == 1, log[-4000:]
    assert "received SIGUSR1" in log and "preemption: saved" in log and "requeued SLURM job" in log
    lines = _attempt_lines(log)
    assert f"attempt 2 of job {job_id}: resuming from step 7 (" in "\n".join(lines), "\n".join(lines)
    assert recorded_batches(run) == recorded_batches(reference)
    a, b = load_file(reference / "student" / "model.safetensors"), load_file(run / "student" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the uninterrupted job"


def test_the_hand_written_example_script_runs_and_keeps_its_output(cluster, tmp_path):
    """slurm/example.sbatch, unedited, submitted from a folder laid out as the repository it is written for (the venv,
    recipes/ and slurm/ linked in): sbatch's own options shrink its 2 x 8-GPU allocation to this one-node cluster
    without GPUs (command-line options override #SBATCH lines); the job starts, and its output is where the file's
    --output says, holding what the fit printed. The file sent --output into slurm-logs/, which only the script
    itself created, after slurmd had needed it to open the output: such a job fails with no output at all."""
    venv = Path(sys.prefix)
    if not (venv / "bin" / "draftsmith").exists():
        pytest.skip("the tests run outside the virtualenv the example script names (.venv/bin/draftsmith)")
    example = ROOT / "slurm" / "example.sbatch"
    for name, target in ((".venv", venv), ("recipes", ROOT / "recipes"), ("slurm", ROOT / "slurm")):
        (tmp_path / name).symlink_to(target)
    options = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", example.read_text(), flags=re.MULTILINE))
    shrink = ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0", "--time=00:10:00"]
    proc = subprocess.run(
        ["sbatch", "--parsable", *shrink, "slurm/example.sbatch"],
        cwd=tmp_path, env=cluster.env(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    deadline = time.monotonic() + JOB_TIMEOUT
    while cluster.job_info(job_id).get("JobState") not in FINAL_STATES and time.monotonic() < deadline:
        time.sleep(0.5)
    output = tmp_path / options["output"].replace("%x", options["job-name"]).replace("%j", job_id)
    assert output.exists(), f"no job output at {output}: {sorted(p.name for p in tmp_path.iterdir())}"
    # the fit ran and said why it stopped: the recipe's corpus is not in this folder (no traceback: a user's error)
    text = output.read_text(errors="replace")
    assert "error: data.train_files: data file not found: artifacts/corpus/train.jsonl" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
