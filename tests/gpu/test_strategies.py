"""ZeRO-2, ZeRO-3 and FSDP2 on one GPU: the real ``draftsmith fit`` (one process, nccl) of the KD recipe
(recipes/quickstart/kd.yaml with recipes/_base/<strategy>) on the real-shape cut target with a real-width student
(tests/real_width.REAL_STUDENT), bf16-mixed: stopped after 2 steps, resumed from ``last`` to step 3. The three runs go
side by side (one GPU holds them), then the three resumes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.gpu.conftest import REPO
from tests.real_width import REAL_STUDENT
from tests.recipe_runs import RECIPES, kd_override, record_batches, write_override

pytestmark = pytest.mark.gpu
STRATEGIES = {"zero2": "deepspeed_zero2.yaml", "zero3": "deepspeed_zero3.yaml", "fsdp2": "fsdp.yaml"}
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(run: Path, cut_target: Path, text_data: Path, strategy: str, resume: bool) -> list[str]:
    corpus = SimpleNamespace(tokenizer_dir=cut_target, train_file=text_data, heldout_file=text_data, out_dir=run)
    callbacks = [record_batches(run), {"class_path": "tests.callbacks.StopAtStep", "init_args": {"step": 2}}]
    override = kd_override(
        run, corpus, cut_target, 3, 2, 1, callbacks, drafter_config=REAL_STUDENT, target_dtype="bfloat16",
        loss_chunk_size=1024,
    )  # fmt: skip
    override["data"]["init_args"]["seq_len"] = 512
    override["trainer"]["precision"] = "bf16-mixed"
    if resume:  # the resumed run goes to max_steps
        override["trainer"]["callbacks"] = [c for c in override["trainer"]["callbacks"] if "StopAtStep" not in str(c)]
    path = write_override(run / ("resume.yaml" if resume else "override.yaml"), override)
    cmd = [str(Path(sys.executable).parent / "draftsmith"), "fit", "--config", str(RECIPES / "quickstart/kd.yaml")]
    cmd += ["--config", str(RECIPES / "_base" / STRATEGIES[strategy]), "--config", str(path)]
    cmd += ["--trainer.accelerator", "gpu", "--trainer.devices", "1"]
    return cmd + (["--ckpt_path", "last"] if resume else [])


def run_all(tmp: Path, cut_target: Path, text_data: Path, resume: bool) -> dict[str, tuple[int, str]]:
    """Every strategy's fit at once; {strategy: (exit code, output tail)}."""
    procs = {}
    for name in STRATEGIES:
        run = tmp / name
        run.mkdir(exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        log = (run / ("resume.log" if resume else "fit.log")).open("w")
        cmd = command(run, cut_target, text_data, name, resume)
        procs[name] = (subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log, run)
    out = {}
    for name, (proc, log, run) in procs.items():
        try:
            code = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -9
        log.close()
        text = (run / ("resume.log" if resume else "fit.log")).read_text()
        out[name] = (code, text[-3000:])
    return out


@pytest.fixture(scope="module")
def fits(cut_target, text_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("strategies")
    first = run_all(tmp, cut_target, text_data, resume=False)
    resumed = run_all(tmp, cut_target, text_data, resume=True)
    return tmp, first, resumed


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_fit_stop_and_resume_on_one_gpu(strategy, fits):
    import json

    from tests.integration.test_kd_distributed import frozen_tensors_in

    tmp, first, resumed = fits
    run = tmp / strategy
    code, tail = first[strategy]
    assert code == 0, f"{strategy} fit failed (exit {code}):\n{tail}"
    code, tail = resumed[strategy]
    assert code == 0, f"{strategy} resume failed (exit {code}):\n{tail}"
    steps = [json.loads(line)["step"] for line in (run / "batches.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2], f"the resumed run did not continue at step 2: {steps}"
    checkpoints = [p for p in (run / "checkpoints").iterdir() if p.name.endswith(".ckpt")]
    assert checkpoints and all(frozen_tensors_in(p) == [] for p in checkpoints)
    assert (run / "student" / "model.safetensors").is_file(), "the end-of-fit export is missing"
