"""``draftsmith slurm submit``: render an sbatch script for a recipe from slurm/train.sbatch.in and submit it.

    draftsmith slurm submit --config recipes/quickstart/kd.yaml --nodes 2 --gpus-per-node 8 \
        --partition gpu --account myproject --time 24:00:00 [--dry-run] [-- --trainer.max_steps 1000]

The script runs one task per device (``--ntasks-per-node`` equal to ``trainer.devices``, as Lightning's SLURM
environment requires), ``--cpus-per-task`` sized for the recipe's ``data.init_args.num_workers`` (workers plus the
main process), USR1 to the tasks ``--signal-lead`` seconds before the time limit, ``--requeue`` and
``--open-mode=append``, and ``srun python -m trainer.cli fit`` with the recipe's configs, the overrides that make
``trainer.num_nodes``, ``trainer.devices`` and ``trainer.accelerator`` match the allocation, the
:class:`trainer.preemption.PreemptionCheckpoint` callback and ``--ckpt_path last`` (so a requeued job resumes).
``--gpus-per-node 0`` renders a CPU job (``accelerator cpu``, ``--tasks-per-node`` processes per node).
``--dry-run`` prints the script; otherwise it is written to the log folder and submitted, and the job id is printed.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

import yaml

TEMPLATE = Path(__file__).resolve().parents[1] / "slurm" / "train.sbatch.in"
PREEMPTION_CALLBACK = "trainer.preemption.PreemptionCheckpoint"


@dataclass
class SlurmJob:
    """Everything the sbatch template needs; :func:`render` turns it into a script."""

    configs: list[str]  # recipe YAMLs, in --config order
    nodes: int = 1  # nodes of the allocation
    gpus_per_node: int = 0  # GPUs per node; 0 renders a CPU job
    tasks_per_node: int | None = None  # processes per node (default: gpus_per_node, or 1 on CPU)
    cpus_per_task: int | None = None  # CPUs per process (default: the recipe's data workers + 1)
    partition: str | None = None  # --partition
    account: str | None = None  # --account
    time: str = "24:00:00"  # --time limit
    job_name: str = "draftsmith"  # --job-name (Lightning's SLURM support refuses "bash" and "interactive")
    signal_lead: int = 120  # seconds between USR1 and the time limit
    log_dir: str = "slurm-logs"  # folder of the job's output (relative to workdir unless absolute)
    workdir: str = "."  # folder the job runs in (relative paths of the recipe resolve from it)
    python: str = sys.executable  # interpreter on the compute nodes with draftsmith installed
    extra_sbatch: list[str] = field(default_factory=list)  # more "#SBATCH" options, e.g. "--qos=high"
    fit_args: list[str] = field(default_factory=list)  # more `draftsmith fit` arguments (overrides)


def _merged_recipe(configs: list[str]) -> dict:
    """The recipe YAMLs merged in order (dicts merge, everything else is replaced), as LightningCLI composes them."""

    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for key, value in b.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    merged: dict = {}
    for path in configs:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"draftsmith slurm: recipe {path} does not exist")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"draftsmith slurm: recipe {path} is not a YAML mapping")
        merged = merge(merged, loaded)
    return merged


def _num_workers(recipe: dict) -> int:
    workers = ((recipe.get("data") or {}).get("init_args") or {}).get("num_workers", 0)
    if not isinstance(workers, int) or workers < 0:
        raise ValueError(f"draftsmith slurm: data.init_args.num_workers must be a non-negative int, got {workers!r}")
    return workers


def _has_preemption_callback(recipe: dict) -> bool:
    callbacks = (recipe.get("trainer") or {}).get("callbacks") or []
    if isinstance(callbacks, dict):
        callbacks = [callbacks]
    return any(isinstance(c, dict) and c.get("class_path") == PREEMPTION_CALLBACK for c in callbacks)


def fit_command_args(job: SlurmJob, recipe: dict) -> list[str]:
    """The arguments after ``python -m trainer.cli fit`` for the job: configs, matching overrides, resume."""
    tasks = resolved_tasks_per_node(job)
    args: list[str] = []
    for config in job.configs:
        args += ["--config", str(Path(config).resolve())]
    args += [
        "--trainer.accelerator",
        "gpu" if job.gpus_per_node > 0 else "cpu",
        "--trainer.num_nodes",
        str(job.nodes),
        "--trainer.devices",
        str(tasks),
    ]
    if not _has_preemption_callback(recipe):
        args.append(f"--trainer.callbacks+={PREEMPTION_CALLBACK}")
    args += list(job.fit_args)
    args += ["--ckpt_path", "last"]
    return args


def resolved_tasks_per_node(job: SlurmJob) -> int:
    if job.gpus_per_node > 0:
        if job.tasks_per_node not in (None, job.gpus_per_node):
            raise ValueError(
                f"draftsmith slurm: --tasks-per-node {job.tasks_per_node} must equal --gpus-per-node "
                f"{job.gpus_per_node} (one process per GPU)"
            )
        return job.gpus_per_node
    return job.tasks_per_node or 1


def render(job: SlurmJob, template: Path = TEMPLATE) -> str:
    """The sbatch script for ``job``, from ``template`` (a string.Template: ``${name}`` fields, ``$$`` for $)."""
    if job.nodes < 1:
        raise ValueError(f"draftsmith slurm: --nodes must be >= 1, got {job.nodes}")
    if job.gpus_per_node < 0:
        raise ValueError(f"draftsmith slurm: --gpus-per-node must be >= 0, got {job.gpus_per_node}")
    if job.tasks_per_node is not None and job.tasks_per_node < 1:
        raise ValueError(f"draftsmith slurm: --tasks-per-node must be >= 1, got {job.tasks_per_node}")
    if job.job_name in ("bash", "interactive"):
        raise ValueError(f"draftsmith slurm: job name {job.job_name!r} makes Lightning ignore the SLURM environment")
    if not template.is_file():
        raise FileNotFoundError(f"draftsmith slurm: template {template} does not exist (see --template)")
    recipe = _merged_recipe(job.configs)
    tasks = resolved_tasks_per_node(job)
    cpus = job.cpus_per_task if job.cpus_per_task is not None else _num_workers(recipe) + 1
    if cpus < 1:
        raise ValueError(f"draftsmith slurm: --cpus-per-task must be >= 1, got {cpus}")
    sbatch_lines = []
    if job.partition:
        sbatch_lines.append(f"--partition={job.partition}")
    if job.account:
        sbatch_lines.append(f"--account={job.account}")
    sbatch_lines += job.extra_sbatch
    env_lines = ["export DS_ACCELERATOR=cpu"] if job.gpus_per_node == 0 else []
    fit_args = fit_command_args(job, recipe)
    # one argument per line, options with their values
    lines: list[str] = []
    for arg in fit_args:
        if lines and not arg.startswith("-") and lines[-1].startswith("--") and " " not in lines[-1]:
            lines[-1] += " " + shlex.quote(arg)
        else:
            lines.append(shlex.quote(arg))
    workdir = Path(job.workdir).resolve()
    log_dir = Path(job.log_dir) if Path(job.log_dir).is_absolute() else workdir / job.log_dir
    try:
        return Template(template.read_text()).substitute(
            job_name=job.job_name,
            nodes=job.nodes,
            tasks_per_node=tasks,
            cpus_per_task=cpus,
            gpu_lines=f"#SBATCH --gpus-per-node={job.gpus_per_node}\n" if job.gpus_per_node > 0 else "",
            time=job.time,
            signal_lead=job.signal_lead,
            log_dir=str(log_dir),
            extra_sbatch_lines="".join(f"#SBATCH {line}\n" for line in sbatch_lines),
            workdir=shlex.quote(str(workdir)),
            env_lines="\n".join(env_lines),
            python=shlex.quote(job.python),
            fit_args=" \\\n".join("  " + line for line in lines),
        )
    except (KeyError, ValueError) as err:
        raise ValueError(f"draftsmith slurm: template {template} has an unknown or malformed field: {err}") from err


def submit(script: str, job: SlurmJob) -> str:
    """Write the script into the log folder and submit it with sbatch; return the job id."""
    workdir = Path(job.workdir).resolve()
    log_dir = Path(job.log_dir) if Path(job.log_dir).is_absolute() else workdir / job.log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{job.job_name}.sbatch"
    path.write_text(script)
    try:
        proc = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, cwd=workdir)
    except FileNotFoundError as err:
        raise RuntimeError("draftsmith slurm: sbatch is not on PATH (is this a SLURM login node?)") from err
    if proc.returncode != 0:
        raise RuntimeError(f"draftsmith slurm: sbatch {path} failed: {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftsmith slurm", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("submit", help="render an sbatch script for a recipe and submit it (or print it)")
    s.add_argument("--config", action="append", required=True, help="recipe YAML (repeat to compose, as for fit)")
    s.add_argument("--nodes", type=int, default=1, help="nodes of the allocation")
    s.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node; 0 renders a CPU job")
    s.add_argument("--tasks-per-node", type=int, help="processes per node (CPU jobs; with GPUs it is gpus-per-node)")
    s.add_argument("--cpus-per-task", type=int, help="CPUs per process (default: data.init_args.num_workers + 1)")
    s.add_argument("--partition", help="SLURM partition")
    s.add_argument("--account", help="SLURM account")
    s.add_argument("--time", default="24:00:00", help="time limit (default 24:00:00)")
    s.add_argument("--job-name", default="draftsmith", help="job name (default draftsmith)")
    s.add_argument("--signal-lead", type=int, default=120, help="seconds between USR1 and the time limit")
    s.add_argument("--log-dir", default="slurm-logs", help="folder of the job's output and script")
    s.add_argument("--workdir", default=".", help="folder the job runs in (default: the current one)")
    s.add_argument("--python", default=sys.executable, help="python with draftsmith on the compute nodes")
    s.add_argument("--sbatch", action="append", default=[], help="extra sbatch option, e.g. --sbatch=--qos=high")
    s.add_argument("--template", type=Path, default=TEMPLATE, help="sbatch template (string.Template fields)")
    s.add_argument("--dry-run", action="store_true", help="print the script instead of submitting it")
    s.add_argument("fit_args", nargs="*", help="after --: more `draftsmith fit` arguments, e.g. --trainer.max_steps 10")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    job = SlurmJob(
        configs=args.config,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node,
        cpus_per_task=args.cpus_per_task,
        partition=args.partition,
        account=args.account,
        time=args.time,
        job_name=args.job_name,
        signal_lead=args.signal_lead,
        log_dir=args.log_dir,
        workdir=args.workdir,
        python=args.python,
        extra_sbatch=args.sbatch,
        fit_args=args.fit_args,
    )
    try:
        script = render(job, args.template)
        if args.dry_run:
            print(script, end="")
            return 0
        job_id = submit(script, job)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(job_id)
    return 0
