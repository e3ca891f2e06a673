"""The KD recipe in 2 processes on CPU through the real ``draftsmith fit``: DDP, DeepSpeed ZeRO-1 and ZeRO-3, FSDP2.

Each rank takes its slice of every global batch (trainer/data/sampler.py), and the KD loss is a mean over equally many
positions per rank, so 2 ranks of batch 2 follow the same trajectory as 1 process of batch 4: same global batches,
same final weights up to float32 reduction order.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests._multiproc import run_group
from tests.recipe_runs import RECIPES, fit, kd_override, record_batches, write_override
from trainer.export.cli import main as export_main

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def rows_per_step(run: Path, world: int) -> list[list[str]]:
    """Per step, the row hashes of every rank in rank order: the global batch."""
    records = [json.loads(line) for line in (run / "batches.jsonl").read_text().splitlines()]
    by_step: dict[int, dict[int, list[str]]] = {}
    for r in records:
        by_step.setdefault(r["step"], {})[r["rank"]] = r["rows"]
    assert sorted(by_step) == list(range(STEPS)) and all(len(v) == world for v in by_step.values()), by_step
    return [sum((by_step[s][rank] for rank in range(world)), []) for s in range(STEPS)]


@pytest.fixture(scope="module")
def single_process_run(tiny_corpus, tiny_target, tmp_path_factory):
    run = tmp_path_factory.mktemp("kd_single")
    fit("quickstart/kd.yaml", kd_override(run, tiny_corpus, tiny_target, STEPS, STEPS, 4, [record_batches(run)]), run)
    return run


def fit_two_processes(
    run: Path, tiny_corpus, tiny_target, strategy: str, torchrun_style: bool, stop_at: int | None = None, resume=False
) -> None:
    callbacks = [record_batches(run)]
    if stop_at is not None:
        callbacks.append({"class_path": "tests.callbacks.StopAtStep", "init_args": {"step": stop_at}})
    every = STEPS if stop_at is None else stop_at
    override = write_override(
        run / "override.yaml", kd_override(run, tiny_corpus, tiny_target, STEPS, every, 2, callbacks)
    )
    cmd = [
        str(Path(sys.executable).parent / "draftsmith"),
        "fit",
        "--config",
        str(RECIPES / "quickstart/kd.yaml"),
        "--config",
        str(RECIPES / "_base" / strategy),
        "--config",
        str(override),
        "--trainer.devices",
        "2",
        "--trainer.accelerator",
        "cpu",
        *(["--ckpt_path", "last"] if resume else []),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = run_group(
        cmd,
        timeout=400,
        log_dir=run / "logs",
        nprocs=2 if torchrun_style else 1,
        env=env,
        rank_env=torchrun_style,
        cwd=str(REPO),
    )
    assert res.ok, f"2-process fit failed (timed out: {res.timed_out}, exit {res.returncodes}):\n{res.output[-5000:]}"


def check_same_as_single_process(run: Path, single: Path) -> None:
    assert rows_per_step(run, 2) == rows_per_step(single, 1), "2 ranks did not see the 1-process global batches"
    a = load_file(single / "student" / "model.safetensors")
    b = load_file(run / "student" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=2e-5, msg=f"{key} differs from the 1-process run")


@pytest.mark.parametrize(
    ("strategy", "torchrun_style"),
    [("ddp.yaml", False), ("deepspeed_zero1.yaml", True)],
)
def test_kd_recipe_in_two_processes_matches_one_process(
    strategy, torchrun_style, single_process_run, tiny_corpus, tiny_target, tmp_path, torch_extensions_dir
):
    run = tmp_path / "run"
    run.mkdir()
    fit_two_processes(run, tiny_corpus, tiny_target, strategy, torchrun_style)
    checkpoints = [p for p in (run / "checkpoints").iterdir() if p.name.endswith(".ckpt")]
    assert checkpoints and all(frozen_tensors_in(p) == [] for p in checkpoints)  # the student and its optimizer only
    check_same_as_single_process(run, single_process_run)
    if strategy == "deepspeed_zero1.yaml":  # ZeRO-1's checkpoint folder converts to the student the fit exported
        check_export_is_the_student(run)


def check_export_is_the_student(run: Path) -> None:
    """``draftsmith export`` of the sharded last.ckpt gives, bit for bit, the student the fit's end exported."""
    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir(), "a DeepSpeed or FSDP2 distributed checkpoint is a directory of shards"
    assert export_main(["--ckpt_path", str(ckpt), "--output_dir", str(run / "exported")]) == 0
    a = load_file(run / "student" / "model.safetensors")
    b = load_file(run / "exported" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)


def frozen_tensors_in(ckpt: Path) -> list[str]:
    """Names of teacher tensors a checkpoint (file, DeepSpeed folder or FSDP2 distributed folder) holds."""
    if ckpt.is_file():
        return [k for k in torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"] if "teacher" in k]
    if (ckpt / "checkpoint").is_dir():  # DeepSpeed: module states and frozen-parameter fragments per rank
        names = []
        for states in (ckpt / "checkpoint").glob("*model_states.pt"):
            data = torch.load(states, map_location="cpu", weights_only=False)
            names += [k for k in data["module"] if "teacher" in k]
            names += [k for k in (data.get("frozen_param_fragments") or {}) if "teacher" in k]
        return names
    from torch.distributed.checkpoint import FileSystemReader

    return [k for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if "teacher" in k]


# ZeRO-1 shares DeepSpeed's checkpoint code with ZeRO-2 (resumed in tests/integration/test_strategies.py); ZeRO-3
# partitions the frozen teacher too, and FSDP2 writes distributed checkpoint folders.
@pytest.mark.parametrize("strategy", ["fsdp.yaml", "deepspeed_zero3.yaml"])
def test_checkpoints_hold_no_teacher_and_resume_exactly(
    strategy, single_process_run, tiny_corpus, tiny_target, tmp_path, torch_extensions_dir
):
    """Stopped at step 2 and resumed in 2 processes: the checkpoint held the student and its optimizer only (the
    teacher is rebuilt from its path), and the run ends with the weights of an uninterrupted 1-process run. The
    end-of-fit export gathers the full weights (ZeRO-3 partitions student and teacher, FSDP2 the student), and
    ``draftsmith export`` puts the sharded checkpoint folder together to the same student."""
    run = tmp_path / "run"
    run.mkdir()
    fit_two_processes(run, tiny_corpus, tiny_target, strategy, True, stop_at=2)
    checkpoints = [p for p in (run / "checkpoints").iterdir() if p.name.endswith(".ckpt")]
    assert checkpoints and all(frozen_tensors_in(p) == [] for p in checkpoints)
    if strategy == "fsdp.yaml":  # a distributed checkpoint folder: one shard per rank
        shards = [sorted(q.name for q in p.glob("*.distcp")) for p in checkpoints]
        assert all(names == ["__0_0.distcp", "__1_0.distcp"] for names in shards), shards
    fit_two_processes(run, tiny_corpus, tiny_target, strategy, True, resume=True)
    check_same_as_single_process(run, single_process_run)
    # the resumed run wrote its last.ckpt over the one it resumed from (not a last-v1.ckpt beside a stale one)
    assert sorted(p.name for p in (run / "checkpoints").glob("last*")) == ["last.ckpt"]
    check_export_is_the_student(run)
