"""What ``draftsmith fit`` prints into a log file (trainer/training/progress.py, trainer/interface/output.py): a
progress line per interval from rank zero only, each message once in one format, no FLOPs, and a closing block naming
the checkpoint on disk and the next commands."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

from tests._multiproc import run_group
from tests.recipe_runs import RECIPES, kd_override, save_random_target, write_override
from trainer.interface.errors import RecipeError
from trainer.interface.output import block, duration
from trainer.training.progress import ProgressLog

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
EVERY = 2
_PROGRESS = re.compile(r"^INFO: step (\d+)/(\d+) \| loss [\d.e+-]+ \| lr [\d.e+-]+ \| [\d,]+ tok/s \| elapsed \S+")


@pytest.fixture(scope="module")
def target(tiny_corpus, tmp_path_factory) -> Path:
    return save_random_target(tmp_path_factory.mktemp("fit_output") / "target", tiny_corpus.tokenizer_dir)


def _fit(run: Path, tiny_corpus, target: Path, devices: int = 1) -> str:
    """``draftsmith fit`` of the KD recipe for :data:`STEPS` steps of the tiny student, output to a file, Lightning's
    defaults for the progress bar and the model summary; returns the file's text."""
    run.mkdir(parents=True)
    override = kd_override(run, tiny_corpus, target, max_steps=STEPS, every_n=STEPS)
    del override["trainer"]["enable_progress_bar"]  # the default: what a user's run does off a terminal
    override["trainer"]["enable_model_summary"] = True
    override["trainer"]["val_check_interval"] = 3
    cmd = [
        str(Path(sys.executable).parent / "draftsmith"),
        "fit",
        "--config",
        str(RECIPES / "quickstart" / "kd.yaml"),
        *(["--config", str(RECIPES / "_base" / "ddp.yaml")] if devices > 1 else []),
        "--config",
        str(write_override(run / "override.yaml", override)),
        "--progress.every_n_steps",
        str(EVERY),
        "--trainer.devices",
        str(devices),
        "--trainer.accelerator",
        "cpu",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = run_group(cmd, timeout=300, log_dir=run / "logs", env=env, cwd=str(REPO))
    assert res.ok, f"fit failed (timed out: {res.timed_out}, exit {res.returncodes}):\n{res.output[-5000:]}"
    return (run / "logs" / "proc0.log").read_text()


def _progress_steps(log: str) -> list[int]:
    return [int(m[1]) for line in log.splitlines() if (m := _PROGRESS.match(line))]


def _expected_steps() -> list[int]:
    """The steps with a line: every EVERY-th and the last (a loop over the steps, not the callback's rule)."""
    return [step for step in range(1, STEPS + 1) if step % EVERY == 0 or step == STEPS]


@pytest.mark.slow
def test_a_fit_into_a_file_prints_progress_each_message_once_and_a_summary(tiny_corpus, target, tmp_path):
    log = _fit(tmp_path / "run", tiny_corpus, target)
    lines = log.splitlines()
    # progress: a line at every interval, none twice (every_seconds' default of 120 s adds none in a run this short)
    assert _progress_steps(log) == _expected_steps(), log
    assert any(re.match(r"^INFO: step 3/4 \| val loss [\d.]+$", line) for line in lines), log
    # each message once, one format: no message both bare and with a logger name (Lightning's own handler)
    bare = {line.split(": ", 1)[1] for line in lines if re.match(r"^[A-Z]+: ", line)}
    named = {line.split(": ", 1)[1] for line in lines if re.match(r"^[A-Z]+ [\w.]+: ", line)}
    assert not bare & named, bare & named
    assert sum("Seed set to 0" in line for line in lines) == 1, log
    logged = [line for line in lines if re.match(r"^(INFO|WARNING|ERROR)[ :]", line)]
    assert len(logged) == len(set(logged)), [line for line in logged if logged.count(line) > 1]
    assert sum("max_steps=4` reached" in line for line in lines) == 1, log
    # the noise is gone, the model summary stays
    assert "Total params" in log and "FLOPs" not in log and "Total Flops" not in log
    assert "litlogger" not in log and "LeafSpec" not in log and "Loading weights" not in log
    assert "Epoch 0/-2" not in log
    # the closing block: the checkpoint on disk and the next commands
    title = next(i for i, line in enumerate(lines) if line.startswith("== fit done in "))
    rows = dict(re.match(r"^(\w+)\s+(.*)$", line).groups() for line in lines[title + 1 :] if re.match(r"^\w+\s", line))
    checkpoint = Path(rows["checkpoint"])
    assert checkpoint.name == "last.ckpt" and checkpoint.exists()
    assert Path(rows["export"]).is_dir() and rows["export"] == str(tmp_path / "run" / "student")
    assert rows["steps"] == f"{STEPS}/{STEPS}" and rows["tokens"].endswith(" of training steps")
    assert re.fullmatch(r"\S+ wall clock, \S+ of it in training steps", rows["time"]), rows["time"]
    assert rows["next"].startswith(f"draftsmith eval --target {target} --drafter {tmp_path / 'run' / 'student'} ")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_two_process_fit_prints_progress_from_rank_zero_only(tiny_corpus, target, tmp_path):
    log = _fit(tmp_path / "run", tiny_corpus, target, devices=2)  # rank 1 writes into the same file
    assert "distributed_backend=gloo" in log or "All distributed processes registered" in log, log
    assert _progress_steps(log) == _expected_steps(), log
    assert sum(line.startswith("== fit done in ") for line in log.splitlines()) == 1, log


def test_progress_line_reads_the_logged_values(caplog):
    """The line of a step, from the trainer's metrics, against its values formatted by hand."""
    import torch

    class Trainer:
        global_step, max_steps, current_epoch = 120, 600, 0
        callbacks: list = []
        callback_metrics = {
            "train/loss": torch.tensor(2.3125),
            "train/lr": torch.tensor(3e-4),
            "train/tokens_per_s": torch.tensor(1734.4),
            "val/loss": torch.tensor(2.5),
        }

    progress = ProgressLog(every_n_steps=50, every_seconds=0)
    progress.started, progress.ended, progress._first_step = 0.0, 130.0, 0
    assert progress.line(Trainer()) == (
        f"step 120/600 | loss {2.3125:.4g} | lr {3e-4:.1e} | 1,734 tok/s | elapsed 2m10s | "
        f"eta {duration(130 / 120 * 480)} | val loss 2.5"
    )


@pytest.mark.parametrize(("key", "value"), [("every_n_steps", -1), ("every_seconds", -5.0)])
def test_progress_refuses_negative_intervals(key, value):
    with pytest.raises(RecipeError, match=f"progress.{key}: .*{value}"):
        ProgressLog(**{key: value})


def test_block_aligns_rows_drops_empty_ones_and_lists_the_next_commands():
    rows = [("checkpoint", "a/last.ckpt"), ("tau", ""), ("loss", "1\n2")]
    text = block("fit done in 2m10s", rows, ["cmd 1", "cmd 2"])
    assert text.splitlines() == [
        "== fit done in 2m10s " + "=" * (72 - len("fit done in 2m10s")),
        "checkpoint  a/last.ckpt",
        "loss        1",
        "            2",
        "next        cmd 1",
        "            cmd 2",
    ]


@pytest.mark.parametrize("seconds", [0, 42, 130, 3599, 3600, 3725])
def test_duration_against_divmod(seconds):
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    expected = f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
    assert duration(seconds) == expected


def test_logging_format_names_the_logger_for_warnings_and_under_debug():
    import io
    import warnings

    from trainer.interface.output import configure_logging

    root = logging.getLogger()
    level, handlers, showwarning, filters = root.level, list(root.handlers), warnings.showwarning, warnings.filters[:]
    bars = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
    try:
        for debug in (False, True):
            stream = io.StringIO()
            configure_logging(debug=debug, stream=stream)
            logging.getLogger("some.module").info("hello")
            logging.getLogger("some.module").warning("careful")
            prefix = "INFO some.module: " if debug else "INFO: "
            assert stream.getvalue().splitlines() == [prefix + "hello", "WARNING some.module: careful"]
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
        warnings.showwarning, warnings.filters[:] = showwarning, filters
        if bars is None:
            os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)


@pytest.mark.parametrize(("max_epochs", "max_steps"), [(-1, 600), (None, 600), (3, -1)])
def test_the_terminal_bar_shows_no_negative_epoch_count(max_epochs, max_steps):
    """Lightning writes ``Epoch 0/{max_epochs - 1}``, ``Epoch 0/-2`` in a fit that max_steps ends; the bar writes the
    epoch alone there and keeps Lightning's text when an epoch limit exists."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import RichProgressBar

    from trainer.training.progress import StepProgressBar

    bar, plain = StepProgressBar(), RichProgressBar()
    bar._trainer = plain._trainer = SimpleNamespace(max_epochs=max_epochs, max_steps=max_steps)
    if max_epochs is not None and max_epochs > 0:
        assert bar._get_train_description(1) == plain._get_train_description(1)
        assert plain._get_train_description(1).rstrip() == f"Epoch 1/{max_epochs - 1}"
    else:
        assert bar._get_train_description(1).rstrip() == f"Epoch 1 (max_steps {max_steps})"


def test_a_cached_data_module_says_it_loaded_its_rows_once(tiny_corpus, tmp_path, caplog):
    """Lightning calls prepare_data, then setup: a second fit over the same data logs the cache it read once."""
    from tests.helpers import text_datamodule

    files = {"train_files": [str(tiny_corpus.train_file)], "val_files": [str(tiny_corpus.heldout_file)]}
    first = text_datamodule(tiny_corpus, tmp_path, seq_len=32, batch_size=2, **files)
    first.prepare_data()
    first.setup("fit")  # builds and caches the rows
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer.data.text"):
        again = text_datamodule(tiny_corpus, tmp_path, seq_len=32, batch_size=2, **files)
        again.prepare_data()
        again.setup("fit")
    loaded = [r for r in caplog.records if r.getMessage().startswith("loaded tokenized rows from")]
    assert len(loaded) == 1 and len(again.train_dataset) == len(first.train_dataset)


@pytest.mark.parametrize("bar", [None, "lightning.pytorch.callbacks.TQDMProgressBar"])
def test_off_a_terminal_the_bar_gives_way_to_the_lines_unless_the_recipe_names_one(bar, tiny_corpus, target, tmp_path):
    """pytest's standard error is no terminal: Lightning's default bar is off (the progress lines print instead), and a
    bar the recipe names is kept (Lightning refuses a named bar with enable_progress_bar false)."""
    from tests.recipe_runs import RECIPES as recipes
    from trainer.training.recipe import DraftsmithCLI

    assert not sys.stderr.isatty()
    override = kd_override(tmp_path, tiny_corpus, target, max_steps=STEPS, every_n=STEPS)
    del override["trainer"]["enable_progress_bar"]
    if bar is not None:
        override["trainer"]["callbacks"].append({"class_path": bar})
    args = ["--config", str(recipes / "quickstart" / "kd.yaml")]  # run=False: no subcommand
    cli = DraftsmithCLI(args=[*args, "--config", str(write_override(tmp_path / "o.yaml", override))], run=False)
    shown = cli.trainer.progress_bar_callback
    assert (shown is None) if bar is None else (type(shown).__name__ == "TQDMProgressBar")
    assert any(isinstance(c, ProgressLog) for c in cli.trainer.callbacks)


class _NotTraining(Callback):
    """What a fit does beside its steps, on the fake clock: 2 s before every batch (loading it) and 10 s after every
    optimizer step (a speculative evaluation, a checkpoint save), in callbacks as the real ones are."""

    def __init__(self, clock: list[float]) -> None:
        """
        Args:
            clock: the fake clock's time, a one-element list the test's perf_counter reads.
        """
        self.clock = clock

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.clock[0] += 2.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.clock[0] += 10.0


def test_the_closing_block_counts_training_steps_alone_and_a_resumed_runs_own_tokens(
    tiny_corpus, tmp_path, monkeypatch
):
    """tokens/s in the block is this run's tokens over its training steps' time (what train/tokens_per_s measures),
    not over the time of the evaluations and loading around them; the wall time is its own row; a run resumed from
    step 3 counts its own 3 steps' tokens and says where it resumed. The reference: the fake clock's step times, added
    up by the test."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    import trainer.training.objective as objective_module
    from tests.unit.test_objective_base import Clocked
    from trainer.training.progress import fit_summary
    from trainer.training.registry import DrafterRecord

    class Saved(Clocked):  # a record for its checkpoints (of no registered kind: the block names no next command)
        def drafter_record(self) -> DrafterRecord:
            return DrafterRecord("probe", {})

    clock = [100.0]
    monkeypatch.setattr(objective_module.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(objective_module, "measure_matmul_peak", lambda *_: None)
    target = str(save_random_target(tmp_path / "target", tiny_corpus.tokenizer_dir))
    B, S = 2, 8
    rows = [{"input_ids": torch.full((S,), i), "loss_mask": torch.ones(S, dtype=torch.bool)} for i in range(12)]

    def run(max_steps: int, ckpt_path: str | None) -> tuple[Clocked, dict[str, str]]:
        probe = Saved(target, clock)
        checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3, save_top_k=-1)
        trainer = pl.Trainer(
            max_steps=max_steps, log_every_n_steps=3, logger=False, enable_progress_bar=False,
            enable_model_summary=False, accelerator="cpu", default_root_dir=str(tmp_path),
            callbacks=[checkpoints, ProgressLog(every_n_steps=0, every_seconds=0), _NotTraining(clock)],
        )  # fmt: skip
        trainer.fit(probe, torch.utils.data.DataLoader(rows, batch_size=B), ckpt_path=ckpt_path)
        text = fit_summary(trainer, probe, ["recipe.yaml"], 100.0, 0)
        lines = text.splitlines()[1:]
        return probe, dict(re.match(r"^(\w+)\s+(.*)$", line).groups() for line in lines if re.match(r"^\w+\s", line))

    for max_steps, resumed in ((3, None), (6, 3)):
        ckpt = None if resumed is None else str(next((tmp_path / "ckpt").glob("*step=3.ckpt")))
        probe, block_rows = run(max_steps, ckpt)
        steps = max_steps - (resumed or 0)
        seconds = sum(5.0 if due else 1.0 for due in probe.due)  # Clocked's steps: 5 s where metrics are due, else 1
        assert len(probe.due) == steps
        assert probe.training_throughput() == (steps * B * S, pytest.approx(seconds))
        assert block_rows["steps"] == f"{max_steps}/{max_steps}" + (f", resumed from step {resumed}" if resumed else "")
        assert block_rows["tokens"] == (
            f"{steps * B * S:,} in this run, {steps * B * S / seconds:,.0f} tokens/s over {duration(seconds)} of "
            "training steps"
        )
        assert block_rows["time"] == f"{duration(100)} wall clock, {duration(seconds)} of it in training steps"


_DEPENDENCY_NOISE = """
import os, sys, tempfile
import torch
import torch.distributed as dist
from trainer.interface.output import configure_logging

configure_logging(debug=sys.argv[1] == "1")
from deepspeed.accelerator import get_accelerator

get_accelerator()  # no DS_ACCELERATOR, no GPU: DeepSpeed says it picked the CPU
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
out = torch.zeros(2)
dist.all_gather_into_tensor(out, torch.ones(2))  # what DeepSpeed's ZeRO calls: torch deprecates it
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="DeepSpeed picks the GPU: no accelerator line")
def test_deepspeed_and_torch_dependency_lines_show_under_debug_only(tmp_path):
    """DeepSpeed's "Setting accelerator to CPU" (on a machine without a GPU) and torch's deprecation of
    all_gather_into_tensor say nothing a user can act on: gone from a run's log unless --debug."""
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "DRAFTSMITH_DEBUG")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    logs = {}
    for debug in ("0", "1"):
        res = subprocess.run(
            [sys.executable, "-c", _DEPENDENCY_NOISE, debug], capture_output=True, text=True, env=env, timeout=300
        )
        assert res.returncode == 0, res.stderr[-3000:]
        logs[debug] = res.stdout + res.stderr
    for line in ("Setting accelerator to CPU", "`torch.distributed.all_gather_into_tensor` is deprecated"):
        assert line not in logs["0"], logs["0"]
        assert line in logs["1"], logs["1"]
