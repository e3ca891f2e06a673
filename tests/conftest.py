"""Shared fixtures: a tiny tokenizer, corpus and target that the suite builds once per session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.shared_fixtures import shared_folder, worker_id


def pytest_configure(config) -> None:
    """Under pytest-xdist (``make test`` runs two workers on two cores), each worker and the processes it starts use
    one thread: two workers of two threads each would oversubscribe the cores."""
    if worker_id() is not None:
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


LOAD_ENV = "DRAFTSMITH_TEST_LOAD"  # set: the tests marked multiprocess run beside tests/cpu_load.py (make test-loaded)
LOAD_SECONDS = 3600.0  # the load ends by itself after this, or when the test session is gone

DURATIONS = Path(__file__).with_name("durations.json")  # seconds per test file, from `make test-durations`


def pytest_addoption(parser) -> None:
    parser.addoption("--record-durations", action="store_true", help=f"write each file's seconds to {DURATIONS.name}")


def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist, the longest test files first: ``make test`` hands out whole files in collection order
    (``--dist loadfile --no-loadscope-reorder``), so the multi-process fits start at once and the short unit files fill
    in at the end, instead of one worker running the last long fit while the other waits. The seconds per file come
    from tests/durations.json (a file missing there counts as a short one); the order inside a file is kept."""
    if worker_id() is None:
        return
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 1.0))


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    _file_seconds[report.nodeid.split("::")[0]] = _file_seconds.get(report.nodeid.split("::")[0], 0.0) + report.duration


def pytest_sessionfinish(session) -> None:
    if session.config.getoption("--record-durations") and worker_id() is None and _file_seconds:
        ordered = dict(sorted(((k, round(v, 1)) for k, v in _file_seconds.items()), key=lambda kv: -kv[1]))
        DURATIONS.write_text(json.dumps(ordered, indent=1) + "\n")


# ------------------------------------------------------------------------------------------------------------ load


@pytest.fixture(scope="session")
def cpu_load():
    """One CPU-bound torch process on one thread (tests/cpu_load.py) for the rest of the session; at the end, checks
    that it was still busy (a load that died early would make a loaded pass a quiet one) and stops it."""
    root = Path(__file__).resolve().parents[1]
    load = subprocess.Popen(
        [sys.executable, "-m", "tests.cpu_load", str(LOAD_SECONDS), str(os.getpid())],
        stdout=subprocess.PIPE, text=True, cwd=str(root), env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert load.stdout.readline().strip() == "busy", "the CPU load did not start"
    yield load
    assert load.poll() is None, f"the CPU load ended early (exit {load.returncode}): the pass was not loaded"
    load.kill()
    load.wait(timeout=30)


@pytest.fixture(autouse=True)
def _loaded_multiprocess_tests(request) -> None:
    """Under DRAFTSMITH_TEST_LOAD=1, every test marked ``multiprocess`` runs beside :func:`cpu_load`."""
    if os.environ.get(LOAD_ENV, "") not in ("", "0") and request.node.get_closest_marker("multiprocess"):
        request.getfixturevalue("cpu_load")


# ---------------------------------------------------------------------------------------------------------- corpus


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A small standard-library corpus with a 512-token byte-level BPE tokenizer (a few seconds, once per session)."""
    from trainer.data.corpus import prepare_corpus

    def build(out):
        prepare_corpus(str(out), vocab_size=512, seed=0, max_files=80)

    out = shared_folder(tmp_path_factory, "tiny_corpus", build)
    return prepare_corpus(str(out), vocab_size=512, seed=0, max_files=80)  # reads the corpus built above


@pytest.fixture(scope="session")
def tok(tiny_corpus):
    """The tiny corpus' tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_corpus.tokenizer_dir)


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread, and far faster on a busy machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def torch_extensions_dir() -> str:
    """One JIT cache for DeepSpeed's C++ ops: $TORCH_EXTENSIONS_DIR, else <repo>/.cache/torch_extensions.

    Builds DeepSpeed's shared-memory collective here, once (one to two minutes on 2 cores when the cache is empty),
    so that the multi-process runs, under their timeout, only load it.
    """
    default = Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"
    path = os.environ.get("TORCH_EXTENSIONS_DIR") or str(default)
    os.environ["TORCH_EXTENSIONS_DIR"] = path
    Path(path).mkdir(parents=True, exist_ok=True)
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        builder.load(verbose=False)
    return path
