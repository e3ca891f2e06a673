"""The real-shape rehearsal: each real-model recipe run on its target's real shapes (tests/real_shapes.py: the
published config with the layer count cut, random weights, the real tokenizer size and special ids) through the real
CLI on one CPU process: ``draftsmith fit`` for a few optimizer steps, ``draftsmith export`` in every format the
method writes, each export read back by its format's loader and compared with the checkpoint's weights
(tests/rehearsal/readback.py), ``draftsmith eval`` on two prompts (it fails when the speculative greedy output differs
from the target's), and ``draftsmith plan`` on the same recipe, overrides and cut target for the memory estimate.

Each case writes ``<results>/<case>.json`` (peak resident memory of the fit process, CPU seconds of every step, the
planner's answer or refusal); ``python -m tests.rehearsal.table`` turns those into docs/benchmarks/rehearsal.md.
Where a case changes a recipe value beyond the CPU overrides (fewer heads or draft layers to fit 24 GB), ``changes``
says so and the table prints it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.real_shapes import build_cut_target

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SEQ_LEN = 128
STEPS = 2
TIMEOUT_S = 3600.0


def work_root() -> Path:
    """Cut targets (reused between runs) and runs: ``DRAFTSMITH_REHEARSAL_DIR``, else ``.cache/rehearsal``. A case
    that passes deletes its checkpoints and exports (``DRAFTSMITH_REHEARSAL_KEEP=1`` keeps them); its logs stay."""
    return Path(os.environ.get("DRAFTSMITH_REHEARSAL_DIR", REPO / ".cache" / "rehearsal"))


def results_dir() -> Path:
    """Where each case's JSON goes: ``DRAFTSMITH_REHEARSAL_RESULTS``, else ``<work_root>/results``."""
    return Path(os.environ.get("DRAFTSMITH_REHEARSAL_RESULTS", work_root() / "results"))


@dataclass(frozen=True)
class Case:
    """One rehearsal: a recipe with its strategy on a cut real model."""

    name: str
    recipe: str
    model: str  # a key of tests.real_shapes.REAL_MODELS
    num_layers: int
    strategy: str | None  # a recipes/_base file, as the recipe's header composes it
    model_args: dict = field(default_factory=dict)  # model.init_args overrides beyond the target
    changes: str = ""  # recipe values changed to fit this machine, for the table
    eval_args: tuple[str, ...] = ()
    eval_target_is_export: bool = False  # LayerSkip: the fine-tuned model is the target
    needs_gib: float = 0.0  # on a machine with less memory available: skipped (with the reason), or run low-memory
    low_memory_precision: str | None = None  # Lightning precision run when needs_gib is not available (in changes)
    eval_refused: str = ""  # a known limit of the engine: eval must refuse this target by name, with these words


DFLASH_CHANGES = "1 draft layer (5 in the recipe: 1.1 B fp32 parameters with Adam need 18 GB), dense attention"

CASES = [
    Case("eagle3_qwen3_8b", "recipes/eagle3_qwen3_8b.yaml", "qwen3_8b", 4, "deepspeed_zero2.yaml"),
    Case("eagle3_llama31_8b", "recipes/eagle3_llama31_8b.yaml", "llama31_8b", 4, "deepspeed_zero2.yaml"),
    Case(
        "dflash_qwen3_8b",
        "recipes/dflash_qwen3_8b.yaml",
        "qwen3_8b",
        4,
        "deepspeed_zero2.yaml",
        {"num_draft_layers": 1, "attention": "dense"},
        DFLASH_CHANGES,
    ),
    Case(
        "dflash_llama31_8b",
        "recipes/dflash_llama31_8b.yaml",
        "llama31_8b",
        4,
        "deepspeed_zero2.yaml",
        {"num_draft_layers": 1, "attention": "dense"},
        DFLASH_CHANGES,
    ),
    Case(
        "dflash_llama31_8b_ci",
        "recipes/dflash_llama31_8b.yaml",
        "llama31_8b",
        2,
        None,
        {"num_draft_layers": 1, "attention": "dense"},
        "the case `make test` runs: " + DFLASH_CHANGES + "; the target cut to 2 layers (so 1 context layer), "
        "no ZeRO-2 (the case above rehearses it)",
        needs_gib=14.0,  # peak 12.2 GiB in float32 (docs/benchmarks/rehearsal.md), and room for the other worker
    ),
    Case(
        "medusa1_llama31_8b",
        "recipes/medusa1_llama31_8b.yaml",
        "llama31_8b",
        2,
        None,
        {"num_heads": 1},
        "1 head (4 in the recipe: 2.2 B fp32 parameters with Adam need 35 GB); no ZeRO-2 (in one float32 process, "
        "as a CPU without native bf16 runs it, its fp32 master copy, gradient partition and buckets take the peak "
        "past 21 GiB, which that machine did not have beside its other jobs; EAGLE-3 and DFlash rehearse ZeRO-2)",
        eval_args=("--k", "1"),  # one head drafts one token a round
    ),
    Case(
        "mtp_refresh_qwen3_5_9b",
        "recipes/mtp_refresh_qwen3_5_9b.yaml",
        "qwen3_5_9b",
        4,
        "deepspeed_zero2.yaml",
        eval_refused="linear_attention layers",  # the engine cuts its cache to take drafts back: no recurrent state
    ),
    Case(
        "layerskip_llama31_8b",
        "recipes/layerskip_llama31_8b.yaml",
        "llama31_8b",
        2,
        "fsdp.yaml",
        eval_args=("--exit_layer", "1"),
        needs_gib=32.0,  # every weight trained: 1.5 B x 16 bytes of fp32 weights, gradients and Adam, and the original
        eval_target_is_export=True,
        low_memory_precision="bf16-true",
    ),
]
BY_NAME = {c.name: c for c in CASES}


def run_precision() -> str:
    """``recipe`` (the recipe's bf16-mixed with the target in bf16) on a CPU that computes bf16 natively, ``fp32``
    elsewhere: PyTorch emulates bf16 there, one conversion per operation, and a real-width fit of two steps did not
    finish in an hour. ``DRAFTSMITH_REHEARSAL_PRECISION`` (``recipe`` or ``fp32``) chooses either."""
    from trainer.models.target import cpu_has_native_bf16

    chosen = os.environ.get("DRAFTSMITH_REHEARSAL_PRECISION") or ("recipe" if cpu_has_native_bf16() else "fp32")
    if chosen not in ("recipe", "fp32"):
        raise ValueError(f"DRAFTSMITH_REHEARSAL_PRECISION must be recipe or fp32, got {chosen!r}")
    return chosen


def short_of_memory(case: Case) -> bool:
    """Whether this machine has less memory available than the case needs at its run precision."""
    return case.needs_gib > available_gib()


def case_precision(case: Case) -> str:
    """:func:`run_precision`, or the case's ``low_memory_precision`` where ``needs_gib`` is not available."""
    if case.low_memory_precision and short_of_memory(case):
        return case.low_memory_precision
    return run_precision()


def low_memory_change(case: Case, precision: str) -> str:
    """What the ``changes`` column says of a case run in its low-memory precision (empty otherwise)."""
    from trainer.models.target import cpu_has_native_bf16

    if precision != case.low_memory_precision:
        return ""
    slow = "" if cpu_has_native_bf16() else ", slow on this CPU"
    return (
        f"{precision}: weights, gradients and AdamW's moments in bf16{slow} (with float32 weights, as float32 and "
        f"bf16-mixed keep them, it needs about {case.needs_gib:.0f} GiB, {available_gib():.1f} GiB available)"
    )


FP32_TRAINER = {"precision": "32-true"}
FP32_MODEL = {"target_dtype": "float32"}  # the recipes' drafters are float32 already


def available_gib() -> float:
    """MemAvailable of /proc/meminfo (Linux), in GiB; infinite elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return float("inf")


def chat_data(path: Path, conversations: int = 48) -> Path:
    """Chat conversations from the standard library's source: the user asks about a file, the assistant answers
    with a piece of it."""
    from trainer.data.corpus import stdlib_python_files

    rows = []
    for source in stdlib_python_files()[:conversations]:
        text = source.read_text(encoding="utf-8", errors="replace")
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"Show me the start of {source.name}."},
                    {"role": "assistant", "content": text[:600]},
                ]
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompts(path: Path) -> Path:
    rows = [
        {"messages": [{"role": "user", "content": "Write a Python function that reverses a list."}]},
        {"messages": [{"role": "user", "content": "Show me the start of os.py."}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def overrides(case: Case, target: Path, data: Path, run: Path, precision: str = "recipe") -> dict:
    """The CPU overrides: one process, a few steps of one short sequence, the cut target and its tokenizer, no
    logger, checkpoints under ``run``; float32 throughout with ``precision="fp32"``, a Lightning precision such as
    ``bf16-true`` as the trainer's with the target in bf16."""
    if precision == "recipe":
        trainer_precision, model_dtype = {}, {}
    elif precision == "fp32":
        trainer_precision, model_dtype = FP32_TRAINER, FP32_MODEL
    else:
        trainer_precision, model_dtype = {"precision": precision}, {"target_dtype": "bfloat16"}
    return {
        "trainer": {
            **trainer_precision,
            "accelerator": "cpu",
            "devices": 1,
            "num_nodes": 1,
            "max_steps": STEPS,
            "accumulate_grad_batches": 1,
            "val_check_interval": None,
            "limit_val_batches": 0,
            "log_every_n_steps": 1,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": str(run),
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(run / "checkpoints"), "save_last": True, "save_top_k": 0},
                }
            ],
        },
        "model": {
            "init_args": {
                "target": str(target),
                **_export_dir(case, run),
                **case.model_args,
                **model_dtype,
            }
        },
        "data": {
            "init_args": {
                "tokenizer": str(target),
                "train_files": [str(data)],
                "val_fraction": 0.0,
                "seq_len": SEQ_LEN,
                "batch_size": 1,
                "num_workers": 0,
                "cache_dir": str(run / "tokenized"),
            }
        },
    }


def _export_dir(case: Case, run: Path) -> dict:
    return {"export_dir": str(run / "model")} if case.eval_target_is_export else {}


def _run(cmd: list[str], log: Path, env: dict) -> dict:
    """Runs ``cmd`` with its output in ``log``; its exit status, wall and CPU seconds and peak resident memory."""
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "rc": proc.returncode,
        "wall_s": round(time.monotonic() - start, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_gib": round(usage.ru_maxrss * 1024 / 1024**3, 2),  # Linux: kilobytes
    }


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))  # DeepSpeed's CPU ops, as make
    return env


def _tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:]


def plan(case: Case, target: Path, override: Path) -> dict:
    """``draftsmith plan`` on the recipe with the same strategy, overrides and cut target, for one process: the
    estimate (``--cpu``: one CPU process's peak, when the planner has it) or its refusal."""
    base = [str(BIN / "draftsmith"), "plan", "--config", case.recipe]
    if case.strategy:
        base += ["--config", f"recipes/_base/{case.strategy}"]
    base += ["--config", str(override), "--target", str(target), "--gpus", "1"]
    answer: dict = {}
    for extra in (["--cpu"], []):
        proc = subprocess.run(base + extra, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=600)
        answer = {"rc": proc.returncode, "stdout": proc.stdout.strip(), "stderr": proc.stderr.strip()[-2000:]}
        if not (proc.returncode != 0 and "--cpu" in proc.stderr and extra):
            break
    answer["estimate_gib"] = planned_gib(answer["stdout"], case.strategy)
    return answer


def planned_gib(stdout: str, strategy: str | None) -> float | None:
    """The planner's estimate for one process: its ``one CPU process`` line, else the row of the recipe's stage."""
    for line in stdout.splitlines():
        if line.startswith("one CPU process") and "GiB" in line:
            return float(line.split(":", 1)[1].split("GiB")[0].strip())
    stage = {"deepspeed_zero2.yaml": "zero2", "fsdp.yaml": "fsdp2"}.get(strategy or "", "ddp")
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == stage and "GiB" in cells[-1]:
            return float(cells[-1].split("GiB")[0].strip().replace(",", ""))
    return None


def _prepare(case: Case, target: Path, run: Path) -> tuple[Path, dict]:
    """The case's chat data and override file in ``run`` (at :func:`case_precision`), and its result's header."""
    precision = case_precision(case)
    override = run / "override.yaml"
    override.write_text(yaml.safe_dump(overrides(case, target, chat_data(run / "chat.jsonl"), run, precision)))
    result = {"case": case.name, "recipe": case.recipe, "model": case.model, "layers": case.num_layers}
    changes = "; ".join(c for c in (case.changes, low_memory_change(case, precision)) if c)
    result.update(strategy=case.strategy, precision=precision, changes=changes)
    return override, result


def rehearse(case: Case) -> dict:
    """Runs one case end to end; writes and returns its result. Raises AssertionError naming the failed step."""
    root = work_root()
    target = build_cut_target(case.model, root / "targets" / f"{case.model}_L{case.num_layers}", case.num_layers)
    run = root / "runs" / case.name
    if run.exists():
        import shutil

        shutil.rmtree(run)
    run.mkdir(parents=True)
    override, result = _prepare(case, target, run)
    precision = result["precision"]
    env = _env()
    result["target_params_b"] = round(_params(target) / 1e9, 3)

    fit = [str(BIN / "draftsmith"), "fit", "--config", case.recipe]
    if case.strategy:
        fit += ["--config", f"recipes/_base/{case.strategy}"]
    fit += ["--config", str(override)]
    result["fit"] = _run(fit, run / "fit.log", env)
    result["plan"] = plan(case, target, override)
    _save(result)
    assert result["fit"]["rc"] == 0, f"fit failed:\n{_tail(run / 'fit.log')}"
    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.exists(), f"no {ckpt}"

    exports, refused = {}, {}
    for fmt in formats_of(ckpt, env):
        out = run / "export" / fmt
        log = run / f"export_{fmt}.log"
        export = ["export", "--ckpt_path", str(ckpt), "--output_dir", str(out), "--format", fmt]
        step = _run([str(BIN / "draftsmith"), *export], log, env)
        last = (log.read_text(errors="replace").strip().splitlines() or [""])[-1]
        if step["rc"] == 2 and last.startswith("error: "):  # a format that does not apply to this target, named
            refused[fmt] = last.removeprefix("error: ")
            continue
        assert step["rc"] == 0, f"export {fmt} failed:\n{_tail(log)}"
        exports[fmt] = {"export": step, "folder": str(out)}
    result["refused_exports"] = refused
    assert exports, f"every export format refused this drafter: {refused}"
    read = [sys.executable, "-m", "tests.rehearsal.readback", str(ckpt), *[e["folder"] for e in exports.values()]]
    result["readback"] = _run(read, run / "readback.log", env)
    result["exports"] = sorted(exports)
    result["export_steps"] = [e["export"] for e in exports.values()]
    _save(result)
    assert result["readback"]["rc"] == 0, f"readback failed:\n{_tail(run / 'readback.log')}"

    first = next(iter(exports.values()))["folder"]
    eval_target = str(run / "model") if case.eval_target_is_export else str(target)
    drafter = eval_target if case.eval_target_is_export else first
    dtype = "float32" if precision == "fp32" else "bfloat16"
    evaluate = [
        str(BIN / "draftsmith"), "eval", "--target", eval_target, "--drafter", drafter,
        "--prompts", str(prompts(run / "prompts.jsonl")), "--k", "2", "--max_new_tokens", "8", "--temperature", "0",
        "--repeats", "1", "--target_dtype", dtype, "--output_dir", str(run / "eval"), *case.eval_args,
    ]  # fmt: skip
    result["eval"] = _run(evaluate, run / "eval.log", env)
    _save(result)
    if case.eval_refused:  # one `error:` line naming the limit, exit 2, no traceback
        errors = [line for line in _tail(run / "eval.log").splitlines() if line.startswith("error: ")]
        refused = result["eval"]["rc"] == 2 and errors and case.eval_refused in errors[-1]
        assert refused, f"eval did not refuse by name ({case.eval_refused!r}):\n{_tail(run / 'eval.log')}"
        result["eval_refused"] = errors[-1].removeprefix("error: ")
    else:
        assert result["eval"]["rc"] == 0, f"eval failed:\n{_tail(run / 'eval.log')}"
        report = json.loads((run / "eval" / "report.json").read_text())
        result["eval_near_ties"] = [t for entry in report["greedy"] for t in entry.get("near_ties", [])]
    result["ok"] = True
    _save(result)
    if not os.environ.get("DRAFTSMITH_REHEARSAL_KEEP"):  # checkpoints and exports of a real width: GBs each
        import shutil

        for name in ("checkpoints", "export", "model"):
            shutil.rmtree(run / name, ignore_errors=True)
    return result


def formats_of(ckpt: Path, env: dict) -> list[str]:
    """Every export format of the checkpoint's drafter kind, read from its record in a subprocess (the checkpoint
    of a real-width drafter is large)."""
    code = (
        "import sys, json; from trainer.checkpoints.reading import load_training_checkpoint; "
        "from trainer.training.registry import DrafterRecord, get_kind; "
        "state, raw = load_training_checkpoint(sys.argv[1]); rec = DrafterRecord.from_dict(raw, sys.argv[1]); "
        "print(json.dumps([f.name for f in get_kind(rec.kind, sys.argv[1]).formats]))"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(ckpt)], capture_output=True, text=True, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _params(target: Path) -> int:
    """Parameters of the cut target's trunk (its MTP tensors left out)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        for key in f.keys():
            if not key.startswith("mtp."):
                n = 1
                for size in f.get_slice(key).get_shape():
                    n *= int(size)
                total += n
    return total


def _save(result: dict) -> None:
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{result['case']}.json").write_text(json.dumps(result, indent=2) + "\n")


def plan_only(case: Case, note: str) -> dict:
    """The planner's answer for ``case`` without running it (the cut target's config and tokenizer, no weights);
    written as the case's result with ``note`` saying why it was not run."""
    from tests.real_shapes import build_tokenizer, cut_config

    root = work_root()
    target = root / "configs" / f"{case.model}_L{case.num_layers}"
    if not (target / "config.json").is_file():
        build_tokenizer(case.model, target)
        (target / "config.json").write_text(json.dumps(cut_config(case.model, case.num_layers), indent=2))
    run = root / "runs" / case.name
    run.mkdir(parents=True, exist_ok=True)
    override, result = _prepare(case, target, run)
    result.update(note=note, target_params_b=None)
    result["plan"] = plan(case, target, override)
    _save(result)
    return result
