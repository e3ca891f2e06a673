"""The GPU suite (``make test-gpu``): what must hold on a CUDA device and cannot be checked on the CPU machines.

Every test here is marked ``gpu`` and skipped, with the reason, where ``torch.cuda.is_available()`` is False. Sized for
about 8 minutes on one H200-class GPU (an estimate until its first run): a real-shape cut target
(``tests/real_shapes.py``, Llama-3.1-8B's published config cut to ``DRAFTSMITH_GPU_LAYERS`` layers, random bf16
weights) built once under ``.cache/gpu_suite``, every objective for ``DRAFTSMITH_GPU_STEPS`` bf16 steps at
``DRAFTSMITH_GPU_SEQ`` tokens (tests/real_width.py, the runner the CPU table uses), flex attention against the
dense path, the engine's greedy identity and tree tests on CUDA, and ZeRO-2, ZeRO-3 and FSDP2 fits of one process
with a resume.

At the end the summary table is printed and ``gpu_results.json`` (``DRAFTSMITH_GPU_RESULTS``) holds tokens/s and peak
memory per objective, and pass/fail/skip of every test with its seconds.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tests.real_width import Result, Settings, markdown_table, write_json

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "gpu_suite"
MODEL = os.environ.get("DRAFTSMITH_GPU_MODEL", "llama31_8b")
LAYERS = int(os.environ.get("DRAFTSMITH_GPU_LAYERS", "4"))
STEPS = int(os.environ.get("DRAFTSMITH_GPU_STEPS", "20"))
SEQ = int(os.environ.get("DRAFTSMITH_GPU_SEQ", "2048"))
RESULTS = Path(os.environ.get("DRAFTSMITH_GPU_RESULTS", REPO / "gpu_results.json"))
NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False (make test-gpu on a GPU machine)"

_objectives: list[Result] = []
_checks: list[dict] = []


def pytest_collection_modifyitems(config, items) -> None:
    here = Path(__file__).parent
    cuda = torch.cuda.is_available()
    for item in items:
        if here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.gpu)
            if not cuda:
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))


def pytest_runtest_logreport(report) -> None:
    """Every GPU test's outcome for gpu_results.json: the call phase, or the setup phase when it skipped or failed."""
    if "tests/gpu/" not in report.nodeid.replace("\\", "/"):
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2])
        elif report.failed:
            reason = str(report.longrepr).strip().splitlines()[-1][:300] if report.longrepr else ""
        _checks.append(
            {"test": report.nodeid.split("tests/gpu/")[-1], "outcome": report.outcome,
             "seconds": round(report.duration, 1), "reason": reason}
        )  # fmt: skip


def record_objective(result: Result) -> None:
    """A row of the summary table (tests/gpu/test_objectives.py)."""
    _objectives.append(result)


def settings() -> Settings:
    """The suite's run settings: the real recipes' precision and drafter sizes, bf16 target."""
    return Settings(device="cuda", precision="bf16-mixed", target_dtype="bfloat16", seq_len=SEQ, steps=STEPS)


def _meta() -> dict:
    meta = {"model": MODEL, "layers": LAYERS, "steps": STEPS, "seq_len": SEQ, "settings": asdict(settings())}
    meta["torch"] = torch.__version__
    meta["machine"] = platform.node()
    if torch.cuda.is_available():
        meta["device"] = torch.cuda.get_device_name(0)
        meta["cuda"] = torch.version.cuda
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        meta["commit"] = commit.stdout.strip()
    except OSError:
        pass
    return meta


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not any(check["outcome"] != "skipped" for check in _checks):
        return  # nothing ran (no CUDA here): no table, no file
    write = terminalreporter.write_line
    terminalreporter.section("GPU suite")
    if _objectives:
        write(f"every objective, {STEPS} bf16 steps of {SEQ} tokens on a {LAYERS}-layer {MODEL} cut:")
        for line in markdown_table(_objectives).splitlines():
            write(line)
        write("")
    write("| test | outcome | s | reason |")
    write("|---|---|---|---|")
    for check in _checks:
        write(f"| {check['test']} | {check['outcome']} | {check['seconds']} | {check['reason'][:100]} |")
    path = write_json(RESULTS, _objectives, _meta(), _checks)
    write(f"written: {path}")


# ---- fixtures ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cut_target() -> Path:
    """The real-shape cut target (built once, reused from .cache/gpu_suite when complete)."""
    from tests.real_shapes import build_cut_target

    return build_cut_target(MODEL, CACHE / f"{MODEL}_{LAYERS}l", LAYERS, torch.bfloat16)


@pytest.fixture(scope="session")
def text_data() -> Path:
    """Standard-library source as a text jsonl: enough rows of SEQ tokens for every run."""
    from tests.real_width import write_text_data

    return write_text_data(CACHE / "text.jsonl", chars=(STEPS + 4) * SEQ * 8)
