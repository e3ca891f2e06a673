"""``draftsmith slurm submit``: render an sbatch script for a recipe from slurm/train.sbatch.in and submit it.

    draftsmith slurm submit --config recipes/quickstart/kd.yaml --nodes 2 --gpus_per_node 8 \
        --partition gpu --account myproject --time 24:00:00 [--dry_run] [-- --trainer.max_steps 1000]

The script runs one task per device (``--ntasks-per-node`` equal to ``trainer.devices``, as Lightning's SLURM
environment requires), ``--cpus-per-task`` sized for the recipe's ``data.init_args.num_workers`` (workers plus the
main process), USR1 to the tasks ``--signal_lead`` seconds before the time limit, ``--requeue`` and
``--open-mode=append``, and ``srun python -m trainer.cli fit`` with the recipe's configs, the overrides that make
``trainer.num_nodes``, ``trainer.devices`` and ``trainer.accelerator`` match the allocation, the
:class:`trainer.distributed.preemption.PreemptionCheckpoint` callback and ``--ckpt_path last`` (so a requeued job
resumes). ``srun --kill-on-bad-exit=1`` ends the step as soon as one task dies; the script then runs
:mod:`trainer.slurm.requeue`, which logs each attempt (what it resumed from, its exit status) and requeues a failed one,
stopping after ``--max_failed_requeues`` (default 3) requeues in a row of attempts that made no progress (the step of
the last complete checkpoint in the recipe's ModelCheckpoint folders did not move). The allocation comes from the recipe
unless the flags say otherwise (:func:`allocation`): ``--nodes`` from ``trainer.num_nodes``; a recipe whose
``trainer.accelerator`` is ``gpu`` (or ``cuda``) renders a GPU job of ``trainer.devices`` GPUs per node; ``cpu`` (or
``auto`` without ``--gpus_per_node``) a CPU job of ``trainer.devices`` processes per node (``accelerator cpu``).
``--gpus_per_node 0`` on a GPU recipe, or ``--gpus_per_node N`` on a CPU recipe, is a contradiction, refused in one line
naming both and the override that settles it. ``--dry_run`` prints the script; otherwise it is written to the log folder
and submitted, and the job id is printed.

The recipe is read by the parser of ``draftsmith fit`` (:func:`trainer.training.recipe.parse_recipe`, nothing
instantiated), with the fit arguments after ``--``: a key fit would refuse is refused before the job is queued, with
fit's message. Every value that goes into the script is checked first (:func:`check_job`): a control character anywhere
(a newline would add a line of its own, run on the cluster), and what SLURM does not accept (partition, account and job
names, the time format, an output folder that ``#SBATCH --output`` cannot hold, an ``--sbatch`` value that is not an
option) are refused with the option and the value named.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Any

from trainer.interface.errors import PathError, RecipeError, UsageError, UserError, debugging, error_report
from trainer.interface.flags import ToolParser

TEMPLATE = Path(__file__).resolve().parents[2] / "slurm" / "train.sbatch.in"
PREEMPTION_CALLBACK = "trainer.distributed.preemption.PreemptionCheckpoint"


@dataclass
class SlurmJob:
    """Everything the sbatch template needs; :func:`render` turns it into a script."""

    configs: list[str]  # recipe YAMLs, in --config order
    nodes: int | None = None  # nodes of the allocation (None: the recipe's trainer.num_nodes)
    gpus_per_node: int | None = None  # GPUs per node; 0 renders a CPU job (None: from the recipe, see allocation)
    tasks_per_node: int | None = None  # processes per node (default: gpus_per_node, or trainer.devices on CPU)
    cpus_per_task: int | None = None  # CPUs per process (default: the recipe's data workers + 1)
    partition: str | None = None  # --partition
    account: str | None = None  # --account
    time: str = "24:00:00"  # --time limit
    job_name: str = "draftsmith"  # --job_name (Lightning's SLURM support refuses "bash" and "interactive")
    signal_lead: int = 120  # seconds between USR1 and the time limit
    max_failed_requeues: int = 3  # requeues in a row after failed attempts without progress; the next one stops
    log_dir: str = "slurm-logs"  # folder of the job's output (relative to workdir unless absolute)
    workdir: str = "."  # folder the job runs in (relative paths of the recipe resolve from it)
    python: str = sys.executable  # interpreter on the compute nodes with draftsmith installed
    extra_sbatch: list[str] = field(default_factory=list)  # more "#SBATCH" options, e.g. "--qos=high"
    fit_args: list[str] = field(default_factory=list)  # more `draftsmith fit` arguments (overrides)


def read_recipe(job: SlurmJob) -> Any:
    """The job's recipe as ``draftsmith fit`` parses it (its configs, then its fit arguments), nothing instantiated.

    A key fit would refuse (misspelled, unknown, of the wrong type) is refused here with fit's message, before a job
    is queued.
    """
    from trainer.training.recipe import parse_recipe

    return parse_recipe(job.configs, job.fit_args)


def _num_workers(recipe: Any) -> int:
    data = recipe.get("data")
    init_args = data.get("init_args") if data is not None else None
    # a datamodule without a num_workers option starts no worker processes of its own
    workers = init_args.get("num_workers", 0) if init_args is not None else 0
    if not isinstance(workers, int) or workers < 0:
        raise RecipeError(f"draftsmith slurm: data.init_args.num_workers must be a non-negative int, got {workers!r}")
    return workers


def checkpoint_folders(job: SlurmJob, recipe: Any) -> list[Path]:
    """The ``dirpath`` of every ModelCheckpoint of the recipe, resolved from the job's workdir: where the requeue
    loop reads the step of the last complete checkpoint.

    Raises:
        RecipeError: the recipe has no ModelCheckpoint with a dirpath (the loop could not tell progress).
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    folders: list[Path] = []
    for callback in recipe.get("trainer.callbacks") or []:
        class_path = getattr(callback, "class_path", None)
        init_args = getattr(callback, "init_args", None)
        if not isinstance(class_path, str) or "." not in class_path or init_args is None:
            continue
        module, _, name = class_path.rpartition(".")
        cls = getattr(sys.modules.get(module), name, None)  # fit's parser imported the class it resolved
        dirpath = init_args.get("dirpath")
        if isinstance(cls, type) and issubclass(cls, ModelCheckpoint) and dirpath:
            folder = Path(str(dirpath))
            folders.append(folder if folder.is_absolute() else Path(job.workdir).resolve() / folder)
    if not folders:
        raise RecipeError(
            "draftsmith slurm: the recipe has no ModelCheckpoint with a dirpath in trainer.callbacks; the job's "
            "requeue loop reads the step of its last checkpoint there"
        )
    return folders


def _has_preemption_callback(recipe: Any) -> bool:
    callbacks = recipe.get("trainer.callbacks") or []
    return any(getattr(c, "class_path", None) == PREEMPTION_CALLBACK for c in callbacks)


# ------------------------------------------------------------------------------------------- what a script may hold

# SLURM's own names: letters, digits, "_", "-", "." (partitions may be a comma-separated list).
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_PARTITIONS = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*")
# sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds, or no limit.
_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE", flags=re.IGNORECASE)
_SIGNAL_LEAD_MAX = 0xFFFF  # sbatch --signal=SIG@TIME: TIME is at most 65535 seconds


def _control_characters(value: str) -> list[str]:
    """The control and line-separator characters of ``value`` (newlines, carriage returns, NUL, escapes...)."""
    return [c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]


def _refuse(option: str, value: str, why: str) -> ValueError:
    return ValueError(f"draftsmith slurm: {option} {value!r} {why}")


def check_job(job: SlurmJob) -> None:
    """Refuses what the rendered script could not hold: a control character (a newline would start a line of its
    own, run on the cluster) in any value, and values SLURM does not accept, each error naming the option and value.
    """
    texts: list[tuple[str, str]] = [
        ("--partition", job.partition or ""),
        ("--account", job.account or ""),
        ("--time", job.time),
        ("--job_name", job.job_name),
        ("--output_dir", job.log_dir),
        ("--workdir", job.workdir),
        ("--python", job.python),
        *(("--sbatch", option) for option in job.extra_sbatch),
        *(("--config", config) for config in job.configs),
        *(("a fit argument", arg) for arg in job.fit_args),
    ]
    for option, value in texts:
        if _control_characters(value):
            raise _refuse(option, value, "holds a control character (a newline would add a line to the script)")
    if job.partition is not None and not _PARTITIONS.fullmatch(job.partition):
        raise _refuse("--partition", job.partition, "is not a SLURM partition name (letters, digits, _ - . and commas)")
    if job.account is not None and not _NAME.fullmatch(job.account):
        raise _refuse("--account", job.account, "is not a SLURM account name (letters, digits, _ - .)")
    if not _TIME.fullmatch(job.time):
        raise _refuse(
            "--time",
            job.time,
            "is not a SLURM time limit (MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, "
            "DAYS-HOURS:MINUTES, DAYS-HOURS:MINUTES:SECONDS or UNLIMITED)",
        )
    if not _NAME.fullmatch(job.job_name) or job.job_name in (".", ".."):
        raise _refuse(
            "--job_name", job.job_name, "is not a job name this script can use (letters, digits, _ - ., not . or ..)"
        )
    if job.job_name in ("bash", "interactive"):
        raise _refuse("--job_name", job.job_name, "makes Lightning ignore the SLURM environment")
    output = str(log_path(job))
    if any(c.isspace() or c in "%'\"\\" for c in output):
        where = f"(in --workdir {str(Path(job.workdir).resolve())!r}) " if not Path(job.log_dir).is_absolute() else ""
        raise _refuse(
            "--output_dir",
            job.log_dir,
            f"{where}gives the output folder {output!r}, which #SBATCH --output cannot hold: no whitespace, quotes, "
            "backslashes, or %, which SLURM expands",
        )
    for option in job.extra_sbatch:
        if not re.fullmatch(r"--?[A-Za-z][A-Za-z0-9-]*([= ].+)?", option):
            raise _refuse("--sbatch", option, "is not an sbatch option (e.g. --sbatch=--qos=high)")
    if not job.python:
        raise _refuse("--python", job.python, "is empty")
    if not 0 <= job.signal_lead <= _SIGNAL_LEAD_MAX:
        raise _refuse("--signal_lead", str(job.signal_lead), f"must lie in 0..{_SIGNAL_LEAD_MAX} seconds")
    if job.max_failed_requeues < 0:
        raise _refuse("--max_failed_requeues", str(job.max_failed_requeues), "must be >= 0")


_GPU_ACCELERATORS = ("gpu", "cuda")


@dataclass(frozen=True)
class Allocation:
    """What the job asks SLURM for: its nodes, GPUs per node (0: a CPU job) and tasks (processes) per node."""

    nodes: int
    gpus_per_node: int
    tasks_per_node: int


def _positive_devices(recipe: Any) -> int | None:
    devices = recipe.get("trainer.devices")
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    return devices if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0 else None


def allocation(job: SlurmJob, recipe: Any) -> Allocation:
    """The job's allocation: the flags where given, else the recipe's ``trainer.num_nodes``, ``trainer.devices`` and
    ``trainer.accelerator`` (with the fit arguments after ``--`` applied).

    Raises:
        UsageError: the flags contradict the recipe's accelerator, or ``--tasks_per_node`` differs from the GPUs.
        RecipeError: a GPU recipe whose ``trainer.devices`` is no count (``auto``, a list) and no ``--gpus_per_node``.
    """
    accelerator = str(recipe.get("trainer.accelerator") or "auto").lower()
    devices = _positive_devices(recipe)
    nodes = job.nodes if job.nodes is not None else int(recipe.get("trainer.num_nodes") or 1)
    if nodes < 1:
        raise UsageError(f"draftsmith slurm: --nodes must be >= 1, got {nodes}")
    gpus = job.gpus_per_node
    if gpus is not None and gpus < 0:
        raise UsageError(f"draftsmith slurm: --gpus_per_node must be >= 0, got {gpus}")
    if accelerator in _GPU_ACCELERATORS and gpus == 0:
        raise UsageError(
            f"draftsmith slurm: --gpus_per_node 0 asks for a CPU job, but the recipe's trainer.accelerator is "
            f"{accelerator}: drop --gpus_per_node, or add `-- --trainer.accelerator cpu` to train on CPUs"
        )
    if accelerator == "cpu" and gpus:
        raise UsageError(
            f"draftsmith slurm: --gpus_per_node {gpus} asks for GPUs, but the recipe's trainer.accelerator is cpu: "
            "drop --gpus_per_node, or add `-- --trainer.accelerator gpu` to train on GPUs"
        )
    if gpus is None and accelerator in _GPU_ACCELERATORS:
        if devices is None:
            raise RecipeError(
                f"draftsmith slurm: the recipe trains on GPUs (trainer.accelerator {accelerator}) but its "
                f"trainer.devices {recipe.get('trainer.devices')!r} is not a count of GPUs: pass --gpus_per_node"
            )
        gpus = devices
    gpus = gpus or 0
    if job.tasks_per_node is not None and job.tasks_per_node < 1:
        raise UsageError(f"draftsmith slurm: --tasks_per_node must be >= 1, got {job.tasks_per_node}")
    if gpus > 0:
        if job.tasks_per_node not in (None, gpus):
            raise UsageError(
                f"draftsmith slurm: --tasks_per_node {job.tasks_per_node} must equal the GPUs per node, {gpus} "
                "(one process per GPU)"
            )
        return Allocation(nodes, gpus, gpus)
    return Allocation(nodes, 0, job.tasks_per_node or devices or 1)


def log_path(job: SlurmJob) -> Path:
    """The folder of the job's output and script: ``log_dir``, relative to ``workdir`` unless absolute."""
    return Path(job.log_dir) if Path(job.log_dir).is_absolute() else Path(job.workdir).resolve() / job.log_dir


def fit_command_args(job: SlurmJob, recipe: Any, alloc: Allocation) -> list[str]:
    """The arguments after ``python -m trainer.cli fit`` for the job: configs, the overrides that match the
    allocation ``alloc``, resume."""
    args: list[str] = []
    for config in job.configs:
        args += ["--config", str(Path(config).resolve())]
    args += [
        "--trainer.accelerator",
        "gpu" if alloc.gpus_per_node > 0 else "cpu",
        "--trainer.num_nodes",
        str(alloc.nodes),
        "--trainer.devices",
        str(alloc.tasks_per_node),
    ]
    if not _has_preemption_callback(recipe):
        args.append(f"--trainer.callbacks+={PREEMPTION_CALLBACK}")
    args += list(job.fit_args)
    args += ["--ckpt_path", "last"]
    return args


def render(job: SlurmJob, template: Path = TEMPLATE) -> str:
    """The sbatch script for ``job``, from ``template`` (a string.Template: ``${name}`` fields, ``$$`` for $)."""
    check_job(job)
    if not template.is_file():
        raise PathError(f"draftsmith slurm: template {template} does not exist (see --template)")
    recipe = read_recipe(job)
    alloc = allocation(job, recipe)
    cpus = job.cpus_per_task if job.cpus_per_task is not None else _num_workers(recipe) + 1
    if cpus < 1:
        raise UsageError(f"draftsmith slurm: --cpus_per_task must be >= 1, got {cpus}")
    sbatch_lines = []
    if job.partition:
        sbatch_lines.append(f"--partition={job.partition}")
    if job.account:
        sbatch_lines.append(f"--account={job.account}")
    sbatch_lines += job.extra_sbatch
    env_lines = ["export DS_ACCELERATOR=cpu"] if alloc.gpus_per_node == 0 else []
    fit_args = fit_command_args(job, recipe, alloc)
    # one argument per line, options with their values
    lines: list[str] = []
    for arg in fit_args:
        if lines and not arg.startswith("-") and lines[-1].startswith("--") and " " not in lines[-1]:
            lines[-1] += " " + shlex.quote(arg)
        else:
            lines.append(shlex.quote(arg))
    workdir = Path(job.workdir).resolve()
    log_dir = log_path(job)
    checkpoint_args = [f"--checkpoints {shlex.quote(str(folder))}" for folder in checkpoint_folders(job, recipe)]
    # the job's own state file, kept across requeues (the log folder holds no quote: check_job)
    state_file = shlex.quote(f"{log_dir}/{job.job_name}-") + '"${SLURM_JOB_ID}"' + shlex.quote(".requeue.json")
    try:
        return Template(template.read_text()).substitute(
            job_name=job.job_name,
            nodes=alloc.nodes,
            tasks_per_node=alloc.tasks_per_node,
            cpus_per_task=cpus,
            gpu_lines=f"#SBATCH --gpus-per-node={alloc.gpus_per_node}\n" if alloc.gpus_per_node > 0 else "",
            time=job.time,
            signal_lead=job.signal_lead,
            log_dir=str(log_dir),
            extra_sbatch_lines="".join(f"#SBATCH {line}\n" for line in sbatch_lines),
            workdir=shlex.quote(str(workdir)),
            env_lines="\n".join(env_lines),
            python=shlex.quote(job.python),
            fit_args=" \\\n".join("  " + line for line in lines),
            max_failed_requeues=job.max_failed_requeues,
            state_file=state_file,
            checkpoint_args=" \\\n".join("  " + arg for arg in checkpoint_args),
        )
    except (KeyError, ValueError) as err:
        raise UsageError(f"draftsmith slurm: template {template} has an unknown or malformed field: {err}") from err


def submit(script: str, job: SlurmJob) -> str:
    """Write the script into the log folder and submit it with sbatch; return the job id."""
    workdir = Path(job.workdir).resolve()
    log_dir = log_path(job)
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


def build_parser() -> ToolParser:
    """The parser of ``draftsmith slurm`` and its ``submit`` subcommand."""
    p = ToolParser(prog="draftsmith slurm", description=(__doc__ or "").split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("submit", help="render an sbatch script for a recipe and submit it (or print it)")
    s.add_argument("--config", action="append", required=True, help="recipe YAML (repeat to compose, as for fit)")
    s.add_argument("--nodes", type=int, help="nodes of the allocation (default: the recipe's trainer.num_nodes)")
    s.add_argument(
        "--gpus_per_node",
        type=int,
        help="GPUs per node; 0 renders a CPU job (default: trainer.devices when trainer.accelerator is gpu, else 0)",
    )
    s.add_argument(
        "--tasks_per_node", type=int, help="processes per node (CPU jobs, default trainer.devices; with GPUs, one each)"
    )
    s.add_argument("--cpus_per_task", type=int, help="CPUs per process (default: data.init_args.num_workers + 1)")
    s.add_argument("--partition", help="SLURM partition")
    s.add_argument("--account", help="SLURM account")
    s.add_argument("--time", default="24:00:00", help="time limit (default 24:00:00)")
    s.add_argument("--job_name", default="draftsmith", help="job name (default draftsmith)")
    s.add_argument("--signal_lead", type=int, default=120, help="seconds between USR1 and the time limit")
    s.add_argument(
        "--max_failed_requeues",
        type=int,
        default=3,
        help="requeues in a row after failed attempts that made no progress; the next such failure stops the job",
    )
    s.add_argument("--output_dir", default="slurm-logs", help="folder of the job's output and script")
    s.add_argument("--workdir", default=".", help="folder the job runs in (default: the current one)")
    s.add_argument("--python", default=sys.executable, help="python with draftsmith on the compute nodes")
    s.add_argument("--sbatch", action="append", default=[], help="extra sbatch option, e.g. --sbatch=--qos=high")
    s.add_argument("--template", type=Path, default=TEMPLATE, help="sbatch template (string.Template fields)")
    s.add_argument("--dry_run", action="store_true", help="print the script instead of submitting it")
    s.add_argument("fit_args", nargs="*", help="after --: more `draftsmith fit` arguments, e.g. --trainer.max_steps 10")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``draftsmith slurm``; returns the exit status (2 for a job it refuses or cannot submit)."""
    args = build_parser().parse_args(argv)
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
        max_failed_requeues=args.max_failed_requeues,
        log_dir=args.output_dir,
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
    except UserError as err:
        if debugging():
            raise
        print(error_report(err), file=sys.stderr)
        return 2
    except (OSError, ValueError, RuntimeError) as err:  # sbatch missing or failing
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(job_id)
    return 0
