"""Runs ``draftsmith`` command lines in fresh processes without paying for the imports each time.

A command line of ``draftsmith`` spends about ten seconds importing torch, Lightning and transformers before it reads
its arguments. :class:`CliServer` starts one Python process that imports them once (``trainer.cli``, Lightning,
transformers' model code, every method's modules), then forks a child per command line: the child starts a
session of its own (a signal or ``killpg`` reaches it as it would a ``Popen(start_new_session=True)`` process), sets
``sys.argv``, the working folder and the environment, sends its standard output and error
to a log file, and runs what the console script runs (``sys.exit(trainer.cli.main())``: an uncaught exception prints
its traceback through ``sys.excepthook`` and exits 1, a ``SystemExit`` exits with its code, the ``atexit`` handlers
run). The server imports only: it runs no torch operation before forking, so no thread pool is copied into a child.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SERVER = r"""
import atexit, json, os, sys
protocol = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # anything the imports print stays off the protocol
import trainer.cli
import trainer.training.recipe  # Lightning, which every fit imports (the tools do not)
import transformers.modeling_utils  # what a model's loading imports, five seconds of it
from trainer.training.registry import kinds
kinds()  # every method's module

def run(request):
    os.setsid()  # a session and process group of its own, as Popen(start_new_session=True) gives
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.argv = ["draftsmith", *request["args"]]
    try:
        code = trainer.cli.main()
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            run(request)
        finally:
            os._exit(70)
    protocol.write(json.dumps({"pid": pid}) + "\n")
    protocol.flush()
    _, status = os.waitpid(pid, 0)
    protocol.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
    protocol.flush()
"""


@dataclass
class CliResult:
    """How a command line ended: its exit status (negative: the signal that killed it) and its output (standard
    output and error, interleaved as written)."""

    status: int
    output: str
    timed_out: bool = False

    @property
    def lines(self) -> list[str]:
        """The non-empty lines of the output."""
        return [line for line in self.output.splitlines() if line.strip()]


class CliChild:
    """A command line :meth:`CliServer.start` started, with ``subprocess.Popen``'s ``pid``, ``returncode``,
    ``poll`` and ``wait``: its exit status, negative for the signal that killed it."""

    def __init__(self, server: CliServer, pid: int, log: Path) -> None:
        self.server, self.pid, self.log = server, pid, log
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status, or None while it runs."""
        if self.returncode is None:
            try:
                self.returncode = json.loads(self.server._read_line(0.0))["status"]
            except TimeoutError:
                return None
        return self.returncode

    def wait(self, timeout: float) -> int:
        """The exit status, waiting at most ``timeout`` seconds (``subprocess.TimeoutExpired``)."""
        if self.returncode is None:
            try:
                self.returncode = json.loads(self.server._read_line(timeout))["status"]
            except TimeoutError:
                raise subprocess.TimeoutExpired(f"draftsmith child {self.pid}", timeout) from None
        return self.returncode


class CliServer:
    """One process that has imported ``trainer.cli``; :meth:`run` forks it per command line (see the module
    docstring). Use as a context manager, or call :meth:`close`."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        """
        Args:
            env: the server's environment, and the base of every command's (default: this process's, with
                ``PYTHONPATH`` holding the repository and ``OMP_NUM_THREADS=1``).
        """
        base = dict(os.environ if env is None else env)
        base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH", "")) if p)
        base.setdefault("OMP_NUM_THREADS", "1")
        base.pop("DRAFTSMITH_DEBUG", None)
        self.env = base
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=base,
            cwd=str(ROOT),
            start_new_session=True,
        )
        self._pending = b""

    def start(
        self, args: Sequence[str], log: Path, cwd: Path | None = None, env: Mapping[str, str] | None = None
    ) -> CliChild:
        """``draftsmith ARGS`` in a fresh child process (its own session), not waited for; its output goes to ``log``.
        One child at a time: wait for it before the next command.

        Args:
            args: the arguments after ``draftsmith``.
            log: the file that receives the command's standard output and error.
            cwd: its working folder (default: the repository).
            env: variables added to the server's environment (a value of None removes one).
        """
        environment = dict(self.env)
        for key, value in (env or {}).items():
            if value is None:
                environment.pop(key, None)
            else:
                environment[key] = value
        request = {"args": [str(a) for a in args], "cwd": str(cwd or ROOT), "env": environment, "log": str(log)}
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        return CliChild(self, json.loads(self._read_line(60.0))["pid"], Path(log))

    def run(
        self,
        args: Sequence[str],
        log: Path,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 300.0,
    ) -> CliResult:
        """``draftsmith ARGS`` in a fresh child process, waited for; its output goes to ``log``.

        Args:
            args: the arguments after ``draftsmith``.
            log: the file that receives the command's standard output and error.
            cwd: its working folder (default: the repository).
            env: variables added to the server's environment (a value of None removes one).
            timeout: seconds before the child is killed (the result then says ``timed_out``).
        """
        child = self.start(args, log, cwd, env)
        try:
            status, timed_out = child.wait(timeout), False
        except subprocess.TimeoutExpired:
            os.kill(child.pid, signal.SIGKILL)
            status, timed_out = child.wait(30.0), True
        return CliResult(status, Path(log).read_text(errors="replace"), timed_out)

    def _read_line(self, timeout: float) -> str:
        """The server's next protocol line, waiting at most ``timeout`` seconds (TimeoutError)."""
        import selectors

        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            with selectors.DefaultSelector() as selector:
                selector.register(fd, selectors.EVENT_READ)
                if not selector.select(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the draftsmith server ended (status {self.proc.poll()})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        """Ends the server."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)

    def __enter__(self) -> CliServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
