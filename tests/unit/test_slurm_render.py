"""`draftsmith slurm submit --dry-run`: the rendered sbatch script matches the allocation and the recipe."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from trainer.slurm import SlurmJob, main, render

ROOT = Path(__file__).resolve().parents[2]
KD = str(ROOT / "recipes" / "quickstart" / "kd.yaml")
ZERO2 = str(ROOT / "recipes" / "_base" / "deepspeed_zero2.yaml")


def _sbatch(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        m = re.match(r"#SBATCH --([\w-]+)(?:=(.*))?$", line)
        if m:
            out[m.group(1)] = m.group(2) or ""
    return out


def _fit_args(script: str) -> list[str]:
    """The arguments after `srun PYTHON -m trainer.cli fit`, with the shell's own splitting."""
    text = script[script.index("srun ") :].replace("\\\n", " ")
    words = shlex.split(text)
    return words[words.index("fit") + 1 :]


def _overrides(args: list[str]) -> dict[str, str]:
    return {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--trainer.")}


def test_gpu_job_matches_allocation(tmp_path, capsys):
    argv = ["submit", "--config", KD, "--config", ZERO2, "--nodes", "2", "--gpus-per-node", "8"]
    argv += ["--partition", "gpu", "--account", "proj", "--time", "12:00:00", "--workdir", str(tmp_path), "--dry-run"]
    argv += ["--", "--trainer.max_steps", "7"]
    assert main(argv) == 0
    script = capsys.readouterr().out
    sb = _sbatch(script)
    assert sb["nodes"] == "2" and sb["ntasks-per-node"] == "8" and sb["gpus-per-node"] == "8"
    assert sb["partition"] == "gpu" and sb["account"] == "proj" and sb["time"] == "12:00:00"
    assert sb["signal"] == "USR1@120" and "requeue" in sb and sb["open-mode"] == "append"
    assert sb["cpus-per-task"] == "1"  # kd.yaml has no dataloader workers: the main process only
    args = _fit_args(script)
    over = _overrides(args)
    assert over["--trainer.num_nodes"] == "2" and over["--trainer.devices"] == "8"
    assert over["--trainer.accelerator"] == "gpu" and over["--trainer.max_steps"] == "7"
    assert [args[i + 1] for i, a in enumerate(args) if a == "--config"] == [KD, ZERO2]
    assert "--trainer.callbacks+=trainer.preemption.PreemptionCheckpoint" in args
    assert args[-2:] == ["--ckpt_path", "last"]
    assert f"cd {tmp_path}" in script and "DS_ACCELERATOR" not in script
    assert not re.search(r"\$\{?\w+\}?", script.replace("${SLURM", "").replace("$(date", "").replace("$$", ""))


def test_cpu_job_uses_tasks_per_node_and_workers(tmp_path):
    recipe = tmp_path / "workers.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"init_args": {"num_workers": 3}}}))
    script = render(SlurmJob(configs=[KD, str(recipe)], nodes=1, gpus_per_node=0, tasks_per_node=2))
    sb = _sbatch(script)
    assert sb["ntasks-per-node"] == "2" and sb["cpus-per-task"] == "4" and "gpus-per-node" not in sb
    over = _overrides(_fit_args(script))
    assert over["--trainer.accelerator"] == "cpu" and over["--trainer.devices"] == "2"
    assert over["--trainer.num_nodes"] == "1"
    assert "export DS_ACCELERATOR=cpu" in script


def test_callback_already_in_recipe_is_not_added_twice(tmp_path):
    recipe = tmp_path / "cb.yaml"
    cb = {"class_path": "trainer.preemption.PreemptionCheckpoint"}
    recipe.write_text(yaml.safe_dump({"trainer": {"callbacks": [cb]}}))
    args = _fit_args(render(SlurmJob(configs=[KD, str(recipe)])))
    assert not any("PreemptionCheckpoint" in a for a in args)


@pytest.mark.parametrize(
    "job, message",
    [
        (SlurmJob(configs=[KD], gpus_per_node=4, tasks_per_node=2), "must equal --gpus-per-node"),
        (SlurmJob(configs=[KD], nodes=0), "--nodes"),
        (SlurmJob(configs=[KD], job_name="bash"), "bash"),
        (SlurmJob(configs=["no/such/recipe.yaml"]), "no/such/recipe.yaml"),
    ],
)
def test_bad_input_is_named(job, message):
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(message)):
        render(job)


def test_bad_recipe_value_is_named(tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"init_args": {"num_workers": -1}}}))
    assert main(["submit", "--config", str(recipe), "--dry-run"]) == 2
    assert "num_workers" in capsys.readouterr().err
