"""`draftsmith slurm submit --dry_run`: the rendered sbatch script matches the allocation and the recipe."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from trainer.interface.errors import RecipeError, UsageError
from trainer.slurm.submit import SlurmJob, main, render

ROOT = Path(__file__).resolve().parents[2]
KD = str(ROOT / "recipes" / "quickstart" / "kd.yaml")
ZERO2 = str(ROOT / "recipes" / "_base" / "deepspeed_zero2.yaml")
# the real-model fit recipes: 8 GPUs on one node (a precompute recipe runs under torchrun or srun, not fit)
GPU_RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if p.read_text().startswith("# draftsmith fit"))


def _sbatch(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        m = re.match(r"#SBATCH --([\w-]+)(?:=(.*))?$", line)
        if m:
            out[m.group(1)] = m.group(2) or ""
    return out


def _fit_args(script: str) -> list[str]:
    """The arguments after `srun PYTHON -m trainer.cli fit`, up to the `||` that records its status, with the shell's
    own splitting."""
    text = script[script.index("srun ") :].replace("\\\n", " ")
    words = shlex.split(text)
    return words[words.index("fit") + 1 : words.index("||")]


def _overrides(args: list[str]) -> dict[str, str]:
    return {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--trainer.")}


def test_gpu_job_matches_allocation(tmp_path, capsys):
    argv = ["submit", "--config", KD, "--config", ZERO2, "--nodes", "2", "--gpus_per_node", "8"]
    argv += ["--partition", "gpu", "--account", "proj", "--time", "12:00:00", "--workdir", str(tmp_path), "--dry_run"]
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
    assert "--trainer.callbacks+=trainer.distributed.preemption.PreemptionCheckpoint" in args
    assert args[-2:] == ["--ckpt_path", "last"]
    assert f"cd {tmp_path}" in script and "DS_ACCELERATOR" not in script
    shell = ("${SLURM", "$(date", "$$", '"${requeue[@]}"', "status=$?", '"$status"')  # the script's own variables
    for text in shell:
        script = script.replace(text, "")
    assert not re.search(r"\$\{?\w+\}?", script)


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
    cb = {"class_path": "trainer.distributed.preemption.PreemptionCheckpoint"}
    ckpt = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": "ckpts"}}
    recipe.write_text(yaml.safe_dump({"trainer": {"callbacks": [ckpt, cb]}}))
    args = _fit_args(render(SlurmJob(configs=[KD, str(recipe)])))
    assert not any("PreemptionCheckpoint" in a for a in args)


def test_the_requeue_loop_reads_the_recipes_checkpoint_folder(tmp_path):
    """srun ends the step when one task dies; trainer.slurm.requeue runs before and after the fit, on the recipe's
    ModelCheckpoint folder (resolved from the workdir), with the job's state file and its limit."""
    script = render(SlurmJob(configs=[KD], workdir=str(tmp_path), job_name="kd", max_failed_requeues=5))
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert srun.split()[:2] == ["srun", "--kill-on-bad-exit=1"]
    loop = script[script.index("requeue=(") : script.index('"${requeue[@]}" start')].replace("\\\n", " ")
    words = shlex.split(loop.removeprefix("requeue=(").strip().removesuffix(")"))
    recipe = yaml.safe_load(Path(KD).read_text())
    dirpath = next(c["init_args"]["dirpath"] for c in recipe["trainer"]["callbacks"] if "dirpath" in c["init_args"])
    assert words[words.index("--checkpoints") + 1] == str(tmp_path / dirpath)
    assert words[words.index("--max_failed_requeues") + 1] == "5"
    assert words[words.index("--state") + 1] == f"{tmp_path}/slurm-logs/kd-${{SLURM_JOB_ID}}.requeue.json"
    assert script.rstrip().endswith('exec "${requeue[@]}" end --exit_status "$status"')


def test_a_recipe_without_a_checkpoint_folder_is_refused(tmp_path):
    recipe = tmp_path / "none.yaml"
    recipe.write_text(yaml.safe_dump({"trainer": {"callbacks": []}}))
    with pytest.raises(RecipeError, match="no ModelCheckpoint with a dirpath"):
        render(SlurmJob(configs=[KD, str(recipe)]))


@pytest.mark.parametrize(
    "job, message",
    [
        (SlurmJob(configs=[KD], gpus_per_node=4, tasks_per_node=2), "must equal the GPUs per node, 4"),
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
    assert main(["submit", "--config", str(recipe), "--dry_run"]) == 2
    assert "num_workers" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["kd.yaml", "kd_offline.yaml", "eagle3.yaml", "eagle3_offline.yaml"])
def test_quickstart_recipes_render_without_their_artifacts(recipe, tmp_path, monkeypatch):
    """The recipes name artifacts/tiny_target and shards that do not exist here; the workers come from the parsed
    recipe (num_workers: 1 in the offline ones, the datamodule's default 0 in the others)."""
    monkeypatch.chdir(tmp_path)
    script = render(SlurmJob(configs=[str(ROOT / "recipes" / "quickstart" / recipe)], gpus_per_node=2))
    assert _sbatch(script)["cpus-per-task"] == ("2" if "offline" in recipe else "1")
    assert _fit_args(script)[-2:] == ["--ckpt_path", "last"]


def test_preemption_callback_given_after_dashes_by_its_short_name_is_not_added_twice(tmp_path):
    args = _fit_args(render(SlurmJob(configs=[KD], fit_args=["--trainer.callbacks+=PreemptionCheckpoint"])))
    assert [a for a in args if "PreemptionCheckpoint" in a] == ["--trainer.callbacks+=PreemptionCheckpoint"]


def test_a_misspelled_fit_argument_is_refused_before_submitting(capsys):
    assert main(["submit", "--config", KD, "--dry_run", "--", "--trainer.max_step", "3"]) == 2
    out = capsys.readouterr()
    assert "max_step" in out.err and out.out == ""


OPTIONS = {
    "partition": "--partition",
    "account": "--account",
    "time": "--time",
    "job_name": "--job_name",
    "log_dir": "--output_dir",
    "workdir": "--workdir",
    "python": "--python",
    "extra_sbatch": "--sbatch",
    "configs": "--config",
    "fit_args": "a fit argument",
}


@pytest.mark.parametrize("control", ["\n", "\r", "\x00", "\x1b", "\u2028"], ids=repr)
@pytest.mark.parametrize("field", list(OPTIONS))
def test_control_characters_are_refused_in_every_rendered_value(field, control, tmp_path):
    good = {
        "partition": "gpu",
        "account": "proj",
        "time": "1:00:00",
        "job_name": "kd",
        "log_dir": "logs",
        "workdir": str(tmp_path),
        "python": "/usr/bin/python3",
        "extra_sbatch": ["--qos=high"],
        "configs": [KD],
        "fit_args": ["--trainer.max_steps", "5"],
    }
    value = good[field]
    bad = [value[0] + control + "touch x"] + value[1:] if isinstance(value, list) else value + control + "touch x"
    with pytest.raises(ValueError) as err:
        render(SlurmJob(**{**good, field: bad}))
    shown = bad[0] if isinstance(bad, list) else bad
    assert str(err.value).startswith(f"draftsmith slurm: {OPTIONS[field]} {shown!r} ")
    assert "control character" in str(err.value)


def test_a_newline_in_the_partition_adds_no_line_to_the_script(tmp_path, capsys):
    """The report: `--partition $'gpu\\ntouch x'` rendered `touch x` as a line of the script."""
    argv = ["submit", "--config", KD, "--partition", "gpu\ntouch x", "--workdir", str(tmp_path), "--dry_run"]
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and "--partition 'gpu\\ntouch x'" in out.err
    assert not (tmp_path / "slurm-logs").exists()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("partition", "gpu;touch x", "--partition 'gpu;touch x' is not a SLURM partition name"),
        ("partition", "gpu a100", "--partition 'gpu a100' is not a SLURM partition name"),
        ("partition", "", "--partition '' is not a SLURM partition name"),
        ("account", "my proj", "--account 'my proj' is not a SLURM account name"),
        ("account", "$(id)", "--account '$(id)' is not a SLURM account name"),
        ("time", "24h", "--time '24h' is not a SLURM time limit"),
        ("time", "1:2:3:4", "--time '1:2:3:4' is not a SLURM time limit"),
        ("time", "1-", "--time '1-' is not a SLURM time limit"),
        ("job_name", "a/b", "--job_name 'a/b' is not a job name"),
        ("job_name", "..", "--job_name '..' is not a job name"),
        ("job_name", "two words", "--job_name 'two words' is not a job name"),
        ("job_name", "interactive", "--job_name 'interactive' makes Lightning ignore"),
        ("log_dir", "/tmp/my logs", "--output_dir '/tmp/my logs' gives the output folder"),
        ("log_dir", "/tmp/logs-%j", "--output_dir '/tmp/logs-%j' gives the output folder"),
        ("log_dir", "/tmp/it's", '--output_dir "/tmp/it\'s" gives the output folder'),
        ("extra_sbatch", ["qos=high"], "--sbatch 'qos=high' is not an sbatch option"),
        ("extra_sbatch", ["echo hi"], "--sbatch 'echo hi' is not an sbatch option"),
        ("python", "", "--python '' is empty"),
        ("signal_lead", -1, "--signal_lead '-1' must lie in 0..65535"),
        ("max_failed_requeues", -1, "--max_failed_requeues '-1' must be >= 0"),
    ],
)
def test_what_slurm_does_not_accept_is_named(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        render(SlurmJob(configs=[KD], **{field: value}))


def test_a_workdir_the_output_path_cannot_hold_is_named(tmp_path):
    workdir = tmp_path / "my runs"
    with pytest.raises(ValueError, match=re.escape(f"--output_dir 'slurm-logs' (in --workdir {str(workdir)!r})")):
        render(SlurmJob(configs=[KD], workdir=str(workdir)))
    # an absolute log folder elsewhere is fine: the workdir itself is quoted in the script
    script = render(SlurmJob(configs=[KD], workdir=str(workdir), log_dir=str(tmp_path / "logs")))
    assert f"cd {shlex.quote(str(workdir))}" in script


@pytest.mark.parametrize("time", ["30", "30:00", "24:00:00", "2-12", "2-12:30", "2-12:30:00", "UNLIMITED"])
def test_slurm_time_formats_are_accepted(time):
    assert _sbatch(render(SlurmJob(configs=[KD], time=time)))["time"] == time


def test_valid_names_and_options_render_as_given():
    job = SlurmJob(
        configs=[KD],
        partition="gpu-a100,gpu.h100",
        account="my_proj-1",
        job_name="kd.v2-run_1",
        extra_sbatch=["--qos=high", "--exclusive", "--constraint a100"],
    )
    script = render(job)
    sb = _sbatch(script)
    assert sb["partition"] == "gpu-a100,gpu.h100" and sb["account"] == "my_proj-1" and sb["job-name"] == "kd.v2-run_1"
    assert sb["qos"] == "high" and "exclusive" in sb and "#SBATCH --constraint a100" in script


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=[p.stem for p in GPU_RECIPES])
def test_a_gpu_recipe_renders_its_gpu_job_without_flags(recipe, tmp_path, monkeypatch, capsys):
    """No --nodes, --gpus_per_node: the allocation is the recipe's trainer.num_nodes x trainer.devices GPUs (it was
    a one-process CPU job, the recipe's accelerator overridden by --trainer.accelerator cpu)."""
    trainer = yaml.safe_load(recipe.read_text())["trainer"]
    assert trainer["accelerator"] == "gpu" and trainer["devices"] == 8, recipe  # what the test relies on
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--config", str(recipe), "--dry_run"]) == 0
    script = capsys.readouterr().out
    sb = _sbatch(script)
    assert (sb["nodes"], sb["ntasks-per-node"], sb["gpus-per-node"]) == (str(trainer["num_nodes"]), "8", "8")
    over = _overrides(_fit_args(script))
    assert (over["--trainer.accelerator"], over["--trainer.devices"]) == ("gpu", "8")
    assert over["--trainer.num_nodes"] == str(trainer["num_nodes"]) and "DS_ACCELERATOR" not in script


def test_flags_and_fit_arguments_set_the_allocation_over_the_recipe(capsys):
    recipe = str(GPU_RECIPES[0])
    script = render(SlurmJob(configs=[recipe], nodes=2, gpus_per_node=4))
    sb = _sbatch(script)
    assert (sb["nodes"], sb["ntasks-per-node"], sb["gpus-per-node"]) == ("2", "4", "4")
    over = _overrides(_fit_args(script))
    assert (over["--trainer.num_nodes"], over["--trainer.devices"]) == ("2", "4")
    # the fit arguments after -- are the recipe's: 3 nodes, or a CPU job of 2 processes
    assert _sbatch(render(SlurmJob(configs=[recipe], fit_args=["--trainer.num_nodes", "3"])))["nodes"] == "3"
    cpu = render(SlurmJob(configs=[KD], fit_args=["--trainer.devices", "2"]))
    assert _sbatch(cpu)["ntasks-per-node"] == "2" and "gpus-per-node" not in _sbatch(cpu)
    assert _overrides(_fit_args(cpu))["--trainer.accelerator"] == "cpu" and "export DS_ACCELERATOR=cpu" in cpu


@pytest.mark.parametrize(
    "configs, gpus, fit_args, message",
    [
        (
            [str(GPU_RECIPES[0])],
            0,
            [],
            "--gpus_per_node 0 asks for a CPU job, but the recipe's trainer.accelerator is gpu",
        ),
        (
            [KD],
            2,
            ["--trainer.accelerator", "cpu"],
            "--gpus_per_node 2 asks for GPUs, but the recipe's trainer.accelerator is cpu",
        ),
        ([str(GPU_RECIPES[0])], None, ["--trainer.devices", "auto"], "trainer.devices 'auto' is not a count of GPUs"),
    ],
    ids=["gpu-recipe-cpu-flag", "cpu-recipe-gpu-flag", "gpu-recipe-auto-devices"],
)
def test_a_contradiction_is_refused_in_one_line(configs, gpus, fit_args, message, capsys):
    with pytest.raises((UsageError, RecipeError), match=re.escape(message)):
        render(SlurmJob(configs=configs, gpus_per_node=gpus, fit_args=fit_args))
    argv = ["submit", *sum((["--config", c] for c in configs), [])]
    argv += (["--gpus_per_node", str(gpus)] if gpus is not None else []) + ["--dry_run", "--", *fit_args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: draftsmith slurm: ") and message in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if line.startswith("error: ")]) == 1, err
