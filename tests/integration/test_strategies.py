"""ZeRO-2 (recipes/_base/deepspeed_zero2.yaml, the strategy of the 8B recipes) trains a toy model in 2 CPU processes,
checkpoints, resumes, and its checkpoint converts to the trained weights. DDP (through Lightning's own launcher),
ZeRO-1, FSDP2 and ZeRO-3 fit the KD recipe in tests/integration/test_kd_distributed.py, to the weights of one process,
FSDP2 and ZeRO-3 with a resume, ZeRO-1 and ZeRO-3 with ``draftsmith export`` of the sharded checkpoint folder.

Each run goes through a `fit` command line (see `fit_command`, the one place to switch to the project CLI) with a
StateProbe callback that writes per-rank losses, step counts and full gathered weights; the tests compare those.
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

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
BATCH = 4
STEPS = 4  # one epoch: STEPS * BATCH * WORLD samples, so the epoch-end checkpoint lands on the last step
TIMEOUT_S = 300.0  # per 2-process run; the DeepSpeed JIT build happens before, in a fixture


def fit_command(base_config: str, run_dir: Path, max_steps: int, ckpt_path: Path | None = None) -> list[str]:
    """The `fit` command line of one run; switch the first items to the project CLI and add a recipe to swap."""
    cmd = [
        sys.executable,
        str(REPO / "tests" / "integration" / "_toy_fit.py"),
        "fit",
        "--config",
        str(REPO / "recipes" / "_base" / base_config),
        f"--data.num_samples={STEPS * BATCH * WORLD}",
        f"--data.batch_size={BATCH}",
    ]
    cmd += [
        "--trainer.accelerator=cpu",
        f"--trainer.devices={WORLD}",
        "--trainer.num_nodes=1",
        f"--trainer.max_steps={max_steps}",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={run_dir}",
        "--trainer.callbacks+=tests.integration._probe.StateProbe",
        f"--trainer.callbacks.out_dir={run_dir / 'probe'}",
    ]
    if ckpt_path is not None:
        cmd.append(f"--ckpt_path={ckpt_path}")
    return cmd


def run_fit(cmd: list[str], run_dir: Path, torchrun_style: bool) -> dict:
    """Run one 2-process fit under a hard timeout; return the probe's per-rank records and weights.

    torchrun_style: start both ranks at once with torch.distributed environment variables (as torchrun or SLURM
    do); otherwise start one process and let Lightning launch the second rank itself.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    res = run_group(
        cmd,
        timeout=TIMEOUT_S,
        log_dir=run_dir / "logs",
        nprocs=WORLD if torchrun_style else 1,
        env=env,
        rank_env=torchrun_style,
        cwd=str(REPO),
    )
    if not res.ok:
        pytest.fail(f"fit failed (timed out: {res.timed_out}, exit codes {res.returncodes}):\n{res.output[-6000:]}")
    probe = run_dir / "probe"
    out = {}
    for r in range(WORLD):
        out[r] = json.loads((probe / f"rank{r}.json").read_text())
        out[r]["start"] = load_file(str(probe / f"start_rank{r}.safetensors"))
        out[r]["end"] = load_file(str(probe / f"end_rank{r}.safetensors"))
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())[:5]}"
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


def check_trained(run: dict, start_step: int, end_step: int) -> None:
    """Steps counted, loss went down, weights moved, and every rank holds the same weights."""
    for r in range(WORLD):
        assert run[r]["world_size"] == WORLD
        assert (run[r]["start_step"], run[r]["end_step"]) == (start_step, end_step), run[r]
        assert len(run[r]["losses"]) == end_step - start_step
    assert_same_tensors(run[0]["start"], run[1]["start"], "start weights rank 0 vs 1")
    assert_same_tensors(run[0]["end"], run[1]["end"], "end weights rank 0 vs 1")
    unchanged = [k for k in run[0]["end"] if torch.equal(run[0]["end"][k], run[0]["start"][k])]
    assert not unchanged, f"weights did not train: {unchanged[:5]}"
    first = sum(run[r]["losses"][0] for r in range(WORLD)) / WORLD
    last = sum(run[r]["losses"][-1] for r in range(WORLD)) / WORLD
    assert last < first - 0.1, f"loss did not decrease: {first:.4f} -> {last:.4f}"


def fit_once(tmp_path: Path, base_config: str, torchrun_style: bool) -> tuple[dict, Path]:
    run_dir = tmp_path / "first"
    run = run_fit(fit_command(base_config, run_dir, STEPS), run_dir, torchrun_style)
    check_trained(run, 0, STEPS)
    ckpt = run_dir / "checkpoints" / f"epoch=0-step={STEPS}.ckpt"
    assert ckpt.exists(), f"no checkpoint at {ckpt}: {sorted(p.name for p in (run_dir / 'checkpoints').glob('*'))}"
    return run, ckpt


def resume(tmp_path: Path, base_config: str, torchrun_style: bool, first: dict, ckpt: Path) -> tuple[dict, Path]:
    """Resume from ckpt for STEPS more steps: the step count continues from the saved weights on every rank."""
    run_dir = tmp_path / "resumed"
    run = run_fit(fit_command(base_config, run_dir, 2 * STEPS, ckpt_path=ckpt), run_dir, torchrun_style)
    check_trained(run, STEPS, 2 * STEPS)
    for r in range(WORLD):
        assert_same_tensors(first[r]["end"], run[r]["start"], f"rank {r}: resumed weights vs saved weights")
    ckpt2 = run_dir / "checkpoints" / f"epoch=1-step={2 * STEPS}.ckpt"
    assert ckpt2.exists(), f"no checkpoint at {ckpt2}"
    return run, ckpt2


def check_zero_conversion(tmp_path: Path, ckpt: Path, run: dict, step: int, stage: int) -> None:
    """convert_zero_checkpoint_to_fp32_state_dict gives exactly the weights the trained module held."""
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    assert (ckpt / "latest").exists(), f"{ckpt} is not a DeepSpeed checkpoint folder"
    merged = convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "merged.pt")
    assert merged["global_step"] == step
    state = {k: v for k, v in merged["state_dict"].items() if torch.is_floating_point(v)}
    assert_same_tensors(state, run[0]["end"], f"ZeRO-{stage} fp32 conversion vs trained module")


def test_deepspeed_zero2_fits_checkpoints_resumes_and_converts(tmp_path: Path, torch_extensions_dir: str) -> None:
    # ZeRO-1 shares DeepSpeed's checkpoint code with ZeRO-2; ZeRO-1 fits the KD recipe to the weights of one process and
    # exports, ZeRO-3 resumes it exactly and exports, in tests/integration/test_kd_distributed.py.
    first, ckpt = fit_once(tmp_path, "deepspeed_zero2.yaml", torchrun_style=True)
    assert first[0]["strategy"] == "CPUDeepSpeedStrategy"
    second, ckpt2 = resume(tmp_path, "deepspeed_zero2.yaml", True, first, ckpt)
    check_zero_conversion(tmp_path, ckpt2, second, 2 * STEPS, 2)


@pytest.mark.skipif(
    os.environ.get("DRAFTSMITH_TEST_OFFLOAD") != "1",
    reason="compiles DeepSpeed's cpu_adam (minutes on 2 cores); set DRAFTSMITH_TEST_OFFLOAD=1 to run",
)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_offload_fits_and_converts(tmp_path: Path, stage: int, torch_extensions_dir: str) -> None:
    run, ckpt = fit_once(tmp_path, f"deepspeed_zero{stage}_offload.yaml", torchrun_style=True)
    check_zero_conversion(tmp_path, ckpt, run, STEPS, stage)
