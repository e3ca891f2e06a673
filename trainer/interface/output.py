"""What the ``draftsmith`` commands print: one log format, the dependency noise they drop, and the closing block.

Log lines go to standard error through one handler on the root logger, as ``LEVEL: message`` (``WARNING name:
message`` for warnings and errors, where the logger's name says where to look); ``--debug`` names the logger on every
line and keeps everything filtered below. Lightning and transformers each install a handler of their own (Lightning's
``lightning`` logger writes ``INFO: message`` and also propagates to the root logger, so every message printed twice):
:func:`adopt_library_loggers` removes those handlers, so their messages reach the root handler alone. Python warnings
are logged too (``WARNING: message (Category at file:line)``).

Dropped unless ``--debug`` (messages that say nothing the user can act on), each by a filter on its own message:

- Lightning's tip to install litlogger;
- the deprecation warning about ``LeafSpec`` that Lightning's own ``_pytree`` module raises under recent torch;
- transformers' "Token indices sequence length is longer than the specified maximum sequence length": the data
  modules tokenize whole documents and cut them into rows of ``seq_len`` themselves, so no such sequence reaches a
  model;
- DeepSpeed's "Setting accelerator to CPU" on a machine without a GPU, where a CPU run is what the recipe asked for;
- torch's deprecation of ``all_gather_into_tensor``, which DeepSpeed calls, not draftsmith;
- torch's C++ warnings (``TORCH_CPP_LOG_LEVEL=ERROR``, set by trainer/cli.py before torch is imported unless the
  user set it): the stack dump of a store call that fails once a peer died, which the rank reports in one line;
- off a terminal, the tqdm bars of transformers and huggingface_hub (``HF_HUB_DISABLE_PROGRESS_BARS``, unless set).

:class:`CountProgress` is the progress of a tool's long stage: tqdm's bar on a terminal, plain lines in the format of a
fit's (trainer/training/progress.py) off one. :func:`block` is the closing block every command ends with: a title line,
aligned ``label  value`` rows and the next commands to run.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

_HANDLER_NAME = "draftsmith"
PROGRESS_EVERY_SECONDS = 120.0  # a progress line at least this often, off a terminal (fits and tools)
log = logging.getLogger(__name__)

# (logger name prefix, message pattern): log records dropped unless --debug
_NOISE: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("lightning", re.compile(r"Tip: .*litlogger")),
    ("transformers.tokenization_utils_base", re.compile(r"Token indices sequence length is longer than the specified")),
    ("DeepSpeed", re.compile(r"Setting accelerator to CPU")),
)
# (message pattern, module pattern) of Python warnings dropped unless --debug
_NOISY_WARNINGS: tuple[tuple[str, str], ...] = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\..*"),
    (r"`torch.distributed.all_gather_into_tensor` is deprecated", r"torch\.distributed\..*"),
)


class _Format(logging.Formatter):
    """``LEVEL: message`` for info, ``LEVEL name: message`` for warnings and errors, and for every line under
    ``--debug``."""

    def __init__(self, debug: bool) -> None:
        """
        Args:
            debug: name the logger on every line.
        """
        super().__init__()
        self.debug = debug

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        named = self.debug or (record.levelno >= logging.WARNING and record.name not in ("root", "py.warnings"))
        return f"{record.levelname} {record.name}: {message}" if named else f"{record.levelname}: {message}"


class _DropNoise(logging.Filter):
    """Drops the records of :data:`_NOISE`."""

    def filter(self, record: logging.LogRecord) -> bool:
        for prefix, pattern in _NOISE:
            if record.name.startswith(prefix) and pattern.search(str(record.msg)):
                return False
        return True


_DROP = _DropNoise()


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` through the log: ``WARNING: message (Category at file:line)``."""
    logging.getLogger("py.warnings").warning("%s (%s at %s:%s)", message, category.__name__, filename, lineno)


def configure_logging(debug: bool, stream=None) -> None:
    """Installs the root handler of :mod:`trainer.interface.output`'s format at level INFO (replacing one an earlier
    call installed), routes Python warnings through it, drops the noise listed in the module docstring unless ``debug``,
    and adopts Lightning's and transformers' loggers if they are already imported.

    Args:
        debug: keep everything and name the logger on every line.
        stream: where log lines go (None: standard error).
    """
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(_Format(debug))
    # transformers' loggers do not propagate until adopted, DeepSpeed's never: they are filtered where they log
    for name, _ in _NOISE:
        if name.startswith(("transformers", "DeepSpeed")):
            logging.getLogger(name).removeFilter(_DROP)
            if not debug:
                logging.getLogger(name).addFilter(_DROP)
    if not debug:
        handler.addFilter(_DROP)
        for message, module in _NOISY_WARNINGS:
            warnings.filterwarnings("ignore", message=message, module=module)
        if not (sys.stderr.isatty() if stream is None else stream.isatty()):
            os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    warnings.showwarning = _show_warning
    adopt_library_loggers()


def adopt_library_loggers() -> None:
    """Removes the handlers Lightning, transformers and huggingface_hub put on their own loggers, so that their
    messages reach the root handler alone, once and in its format. Does nothing while :func:`configure_logging` has
    not run (the root logger has no handler of ours: a library used from Python keeps its own output) or for a
    library not imported."""
    if not any(h.get_name() == _HANDLER_NAME for h in logging.getLogger().handlers):
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        if name in sys.modules:
            library = logging.getLogger(name)
            for handler in list(library.handlers):
                library.removeHandler(handler)
            library.propagate = True
    if "huggingface_hub" in sys.modules:  # its retries when the hub cannot be reached, once each rather than twice
        hub = logging.getLogger("huggingface_hub")
        for handler in list(hub.handlers):
            hub.removeHandler(handler)
        hub.propagate = True
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()


# ------------------------------------------------------------------------------------------------ closing blocks


def duration(seconds: float) -> str:
    """``42s``, ``2m10s``, ``1h05m``: a duration as a log reads it."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def elapsed_and_eta(elapsed: float, done: float, left: float) -> list[str]:
    """``elapsed 2m10s`` and, when some work is done and some is left, ``eta 8m40s`` at the pace so far: the timing
    fields of every progress line (a fit's steps, trainer/training/progress.py; a tool's items, :class:`CountProgress`).

    Args:
        elapsed: seconds spent on the ``done`` units.
        done: units done in those seconds (steps, sequences, records).
        left: units still to do.
    """
    parts = [f"elapsed {duration(elapsed)}"]
    if done > 0 and left > 0:
        parts.append(f"eta {duration(elapsed / done * left)}")
    return parts


def rate(per_second: float) -> str:
    """``1,734``, ``52.1``, ``3.25``: a rate with three significant digits below 1000, whole units above."""
    if per_second >= 100:
        return f"{per_second:,.0f}"
    return f"{per_second:.1f}" if per_second >= 10 else f"{per_second:.2f}"


class CountProgress:
    """The progress of a tool over a known number of items (``draftsmith precompute``'s sequences, ``generate``'s
    records): tqdm's bar on a terminal; off a terminal (a log file under SLURM or nohup, where a bar's ``\\r`` updates
    pile up) a plain line every ``every_n`` items, at least every ``every_seconds`` (at the first update after) and
    when the last item is done, in the format of a fit's progress lines::

        precompute 96/512 seq | 3.20 seq/s | elapsed 30s | eta 2m10s

    The rate and the time left count the items of this run (a resumed run starts at ``done``) over its time.
    """

    def __init__(
        self,
        what: str,
        total: int,
        unit: str,
        done: int = 0,
        every_n: int | None = None,
        every_seconds: float = PROGRESS_EVERY_SECONDS,
        started: float | None = None,
        stream=None,
    ) -> None:
        """
        Args:
            what: the line's first word and the bar's label, e.g. ``"precompute"``.
            total: the items of the whole job.
            unit: the items' name, e.g. ``"seq"``.
            done: items done before this run (a resumed job).
            every_n: a line every this many items; None: every tenth of the items left.
            every_seconds: a line at least this often (0: none by time).
            started: the ``time.perf_counter()`` at which this run's work began (None: now).
            stream: where the bar goes and whose ``isatty`` chooses bar or lines (None: standard error).
        """
        self.what, self.total, self.unit, self.done, self._first = what, total, unit, done, done
        self.every_n = every_n if every_n is not None else max(1, -(-(total - done) // 10))
        self.every_seconds = every_seconds
        self.started = time.perf_counter() if started is None else started
        self._last_line = time.perf_counter()
        self._last_count = done
        stream = sys.stderr if stream is None else stream
        self.bar = None
        if stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit=unit, desc=what, file=stream, dynamic_ncols=True)

    def update(self, n: int, extra: str = "") -> None:
        """``n`` more items done; ``extra`` (e.g. ``"52.1 tokens/s"``) ends the line, or the bar's postfix."""
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            if extra:
                self.bar.set_postfix_str(extra)
            return
        now = time.perf_counter()
        by_count = self.done // self.every_n > self._last_count // self.every_n
        by_time = self.every_seconds > 0 and now - self._last_line >= self.every_seconds
        if by_count or by_time or self.done >= self.total:
            self._last_line, self._last_count = now, self.done
            log.info(self.line(now - self.started, extra))

    def line(self, elapsed: float, extra: str = "") -> str:
        """The progress line after ``elapsed`` seconds of this run."""
        ran = self.done - self._first
        parts = [f"{self.what} {self.done}/{self.total} {self.unit}"]
        if elapsed > 0:
            parts.append(f"{rate(ran / elapsed)} {self.unit}/s")
        parts += elapsed_and_eta(elapsed, ran, self.total - self.done)
        if extra:
            parts.append(extra)
        return " | ".join(parts)

    def close(self) -> None:
        """Closes the bar (no line is written: the last item's update wrote it)."""
        if self.bar is not None:
            self.bar.close()


def block(title: str, rows: Sequence[tuple[str, str]], next_commands: Sequence[str] = ()) -> str:
    """The closing block of a command: ``== title ==``, one ``label  value`` row per entry (labels aligned; a value
    of several lines continues under the first), then ``next`` and the commands to run next, one per line.

    Args:
        title: what ran and how it ended, e.g. ``"fit done in 2m10s"``.
        rows: (label, value) pairs, in order; an empty value drops its row.
        next_commands: the exact commands to run next.
    """
    rows = [(label, value) for label, value in rows if value]
    if next_commands:
        rows.append(("next", "\n".join(next_commands)))
    width = max((len(label) for label, _ in rows), default=0) + 2
    lines = [f"== {title} " + "=" * max(3, 72 - len(title))]
    for label, value in rows:
        first, *more = value.split("\n")
        lines.append(f"{label:<{width}}{first}")
        lines.extend(" " * width + line for line in more)
    return "\n".join(lines)


NO_PROMPTS = (
    "no held-out prompts in the recipe (data.val_files or a SpeculativeEvalCallback's prompts): "
    "draftsmith eval --prompts FILE measures it"
)


def eval_command(target: str, drafter: str | Path, prompts: str, prompt_tokens: int, out: str | Path) -> str:
    """The ``draftsmith eval`` line that measures ``drafter`` against ``target`` on ``prompts`` (a fit's or an
    export's next command).

    Args:
        target: the target, as the drafter's record names it (a folder or a hub id).
        drafter: the export folder or checkpoint.
        prompts: the held-out prompts file.
        prompt_tokens: the prompt cut the fit's evaluation used (0: whole prompts).
        out: the report folder.
    """
    command = f"draftsmith eval --target {shlex.quote(target)} --drafter {shlex.quote(str(drafter))} "
    command += f"--prompts {shlex.quote(str(prompts))}"
    if prompt_tokens:
        command += f" --prompt_tokens {prompt_tokens}"
    return command + f" --output_dir {shlex.quote(str(out))}"


def recorded_eval_prompts(checkpoint: str | Path) -> tuple[str, int] | None:
    """The prompts file (and ``prompt_tokens``) that a fit's own evaluation used, read from the ``config.yaml`` saved
    beside its checkpoint (trainer/checkpoints/run_folder.py): the SpeculativeEvalCallback's ``prompts``, else the first
    of the data's ``val_files``; None when the config or both are missing."""
    import yaml

    config_file = Path(checkpoint).parent / "config.yaml"
    try:
        config = yaml.safe_load(config_file.read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(config, dict):
        return None
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        if isinstance(callback, dict) and str(callback.get("class_path", "")).endswith("SpeculativeEvalCallback"):
            init_args = callback.get("init_args") or {}
            if isinstance(init_args.get("prompts"), str):
                return init_args["prompts"], int(init_args.get("prompt_tokens") or 0)
    val_files = ((config.get("data") or {}).get("init_args") or {}).get("val_files")
    if isinstance(val_files, list) and val_files and isinstance(val_files[0], str):
        return val_files[0], 0
    return None
