"""The ``draftsmith`` command.

``draftsmith fit --config recipe.yaml [--config more.yaml] [--section.key value ...]`` (and ``validate``) run through
LightningCLI: the objective is chosen by ``model.class_path``, every ``__init__`` signature is the config schema,
unknown or misspelled keys are rejected with the key named, and the resolved config is saved beside the logs and every
checkpoint directory. :func:`parse_recipe` reads a recipe with the same parser without building anything (``draftsmith
plan`` and ``draftsmith slurm submit`` use it). The other subcommands are plain tools, each a module with
``main(argv) -> int``.

Output ------ Log lines go to standard error in one format (trainer/interface/output.py: ``INFO: message``, the logger's
name on warnings, every message once, dependency noise nobody can act on dropped unless ``--debug``). A fit logs
progress lines (trainer/training/progress.py, the recipe's ``progress`` section) and, on global rank 0, ends with a
closing block on standard output: what ran, steps, tokens, time, final losses, tau when measured, the ``last.ckpt``,
export and log folders that exist, and the ``draftsmith export`` and ``draftsmith eval`` commands to run next. The tools
end with such a block too.

Errors ------ A mistake the user can fix is a :class:`~trainer.interface.errors.UserError`, raised where the check is
made (in a tool, in an objective's ``__init__`` or ``setup``, in a datamodule, a DataLoader worker or a callback). Every
subcommand ends it with ``error: <message>`` on standard error, ``hint: <what to do>`` on the next line when there is
one, and exit status 2, without a traceback. Any other exception is a bug of ours and keeps its traceback. ``--debug``
before the subcommand's own arguments (``draftsmith --debug fit ...``), or ``DRAFTSMITH_DEBUG=1``, shows the traceback
of a user error too.

A fit stopped by SIGTERM or Ctrl-C before its last step exits with ``128 + signal`` (143, 130) after saving
``last.ckpt`` (trainer/distributed/preemption.py), which ``--ckpt_path last`` resumes.

Several ranks (DDP, DeepSpeed, FSDP): the error is printed once. Global rank 0 prints its own error. Every rank that
fails records its message in the process group's key-value store (hosted by rank 0). Another rank prints its error,
as ``error: rank N: <message>``, only when rank 0 has not recorded the same message within
:data:`PEER_GRACE_S` seconds (an error raised identically on every rank, say in ``setup``, is printed by rank 0
alone; an error only rank N saw, say a shard only it reads, by rank N); it prints nothing when rank 0 has already
ended (it reported its own failure) or before the process group exists (every rank then runs the same code on the
same recipe: the error is rank 0's too). An exception that is not a user error, on a rank whose peer has recorded a
user error, is a consequence of it (a collective whose peer left): it ends that rank with status 2 without output,
and so does any exception on a rank other than 0 once rank 0 has ended. After reporting, rank 0 stops the other
local ranks of Lightning's process launcher, so that none waits in a collective.

A rank that died (kill -9, out of memory, a lost node): the collectives of the others fail (at once where the connection
closes, else after ``--collective_timeout_s``, trainer/training/recipe.py). Each surviving rank records in the store
that it is alive; rank 0 waits :data:`PEER_GRACE_S` seconds, prints ``error: rank N of W stopped answering at step S``
naming the ranks that did not, and every surviving rank exits with :data:`PEER_LOST_STATUS` (1). When rank 0 itself
died, its store no longer answers: rank 1 prints ``error: rank 1: rank 0 of W stopped answering at step S`` and every
surviving rank exits with status 1 too.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import time

from trainer import __version__
from trainer.interface.errors import DEBUG_ENV, USER_ERROR_STATUS, UserError, debugging, error_report, user_error_in
from trainer.interface.output import adopt_library_loggers, configure_logging

DEBUG_FLAG = "--debug"
TORCH_CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
PEER_GRACE_S = 5.0  # how long a rank other than 0 waits for rank 0's record of the same error before printing its own
_STORE_KEY = "draftsmith/user_error/"

# Subcommands that are tools rather than training runs: name -> "module:function", function(argv) -> exit code.
TOOLS: dict[str, tuple[str, str]] = {
    "prepare": ("trainer.data.corpus:main", "build the bundled corpus and train its tokenizer"),
    "demo": ("trainer.demo:main", "prepare, train a tiny target, distil a student, evaluate both"),
    "eval": ("trainer.decoding.eval_cli:main", "measure a drafter with lossless speculative decoding"),
    "compare": ("trainer.compare.run:main", "train every method on one target, measure all with one engine, report"),
    "export": ("trainer.export.cli:main", "write a trained drafter in a serving engine's format"),
    "precompute": ("trainer.data.precompute:main", "write the target's top-k logits and hidden states to shards"),
    "generate": ("trainer.data.generate:main", "regenerate a chat data set's responses with the target"),
    "slurm": ("trainer.slurm.submit:main", "render and submit an sbatch script for a recipe"),
    "plan": ("trainer.planner:main", "estimate memory per GPU for each ZeRO stage"),
}


def _usage() -> str:
    tools = "\n".join(f"  {name:<10} {help_}" for name, (_, help_) in TOOLS.items())
    return (
        "usage: draftsmith [--debug] <command> [options]\n       draftsmith --version\n\n"
        "training (LightningCLI; see `draftsmith fit --help`):\n"
        "  fit        train with a recipe: draftsmith fit --config recipes/quickstart/kd.yaml\n"
        f"  validate   evaluate the validation loss of a recipe's model\n\ntools:\n{tools}\n\n"
        f"--debug (or {DEBUG_ENV}=1): show the traceback of an error the command would end in one line\n"
        "--version (or -V): print draftsmith's version (draftsmith X.Y.Z) and exit\n"
    )


def _without_debug_flag(args: list[str]) -> tuple[bool, list[str]]:
    """Removes ``--debug`` from before the subcommand and from right after it (before the subcommand's own
    arguments); returns whether it was there."""
    head = 0
    while head < len(args) and args[head] == DEBUG_FLAG:
        head += 1
    found = head > 0
    rest = args[head:]
    if rest:
        tail = 1
        while tail < len(rest) and rest[tail] == DEBUG_FLAG:
            tail += 1
        found = found or tail > 1
        rest = [rest[0], *rest[tail:]]
    return found, rest


def main(argv: list[str] | None = None) -> int:
    """Runs ``draftsmith <command> ...`` (``argv``; None: ``sys.argv[1:]``) and returns the exit status: 0, 2 for a
    user error (or a command line a tool refuses), 128 + signal for a fit a signal stopped; a bug raises."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["--version"], ["-V"]):  # before logging is configured or any command's module is imported
        print(f"draftsmith {__version__}")
        return 0
    debug, args = _without_debug_flag(args)
    if debug:
        os.environ[DEBUG_ENV] = "1"  # the other ranks of a multi-process fit inherit it
        if argv is None:
            sys.argv[1:] = args  # LightningCLI and its process launchers read sys.argv
        else:
            argv = args
    if not debugging():  # torch's C++ warnings (a failed store call's stack dump) only under --debug
        os.environ.setdefault(TORCH_CPP_LOG_LEVEL_ENV, "ERROR")  # read once, when torch is imported: it is not yet
    configure_logging(debug=debugging())
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    try:
        return _run(args, argv)
    except SystemExit as exit_:
        if _lightning_sigterm(exit_):  # how Lightning ends a SIGTERM that no PreemptionCheckpoint acted on
            return 128 + signal.SIGTERM
        raise
    except Exception as err:
        if debugging():
            raise
        status = _end(err)
        if argv is None and _in_multi_process_group():  # a rank's own process: its status, not gloo's teardown
            _exit_now(status)
        return status


def _lightning_sigterm(exit_: SystemExit) -> bool:
    exceptions = sys.modules.get("lightning.pytorch.utilities.exceptions")  # only a fit imports Lightning
    return exceptions is not None and isinstance(exit_, exceptions.SIGTERMException)


def _run(args: list[str], argv: list[str] | None) -> int:
    if args[0] in TOOLS:
        module_name, function_name = TOOLS[args[0]][0].split(":")
        tool = getattr(importlib.import_module(module_name), function_name)
        adopt_library_loggers()  # the libraries the tool imported: their messages once, in the log's format
        return int(tool(args[1:]) or 0)
    if args[0] not in ("fit", "validate"):
        print(f"draftsmith: unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    from trainer.distributed.preemption import exit_status_after_fit
    from trainer.training.recipe import (
        DraftsmithCLI,  # Lightning is imported for fits only: the tools start seconds sooner
    )

    DraftsmithCLI.running_trainer = None
    started = time.monotonic()
    cli = DraftsmithCLI(args=argv)  # None: LightningCLI reads sys.argv, as its subprocess launchers expect
    status = exit_status_after_fit(cli.trainer) if args[0] == "fit" else 0
    if args[0] == "fit" and cli.trainer.is_global_zero:
        from trainer.training.progress import fit_summary

        configs = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--config", "-c")]
        configs += [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
        print(fit_summary(cli.trainer, cli.model, configs, time.monotonic() - started, status), flush=True)
    _close_process_group(status, own_process=argv is None)
    return status


def _close_process_group(status: int, own_process: bool) -> None:
    """Ends this rank's torch.distributed group once its run is over.

    A rank of a multi-process run that owns its process (started as ``draftsmith`` or ``python -m trainer.cli``, as
    every launcher starts a rank) waits for the other ranks at a barrier, so that none leaves while a peer still talks
    to it, flushes its output and exits with ``status`` at once: a gloo group torn down by the interpreter's exit
    aborts a finished rank now and then (``terminate called without an active exception``, status -6: a 2-process
    ZeRO-3 fit on CI, and an FSDP2 resume beside a busy core, each after its closing block), with
    ``destroy_process_group`` first too (DeepSpeed and FSDP2 keep references to the group). Elsewhere (one process,
    or a fit run inside another program) the group is destroyed and the function returns.
    """
    import torch.distributed as dist

    if own_process and _in_multi_process_group():
        try:
            dist.barrier()
        except Exception:  # a peer already gone: nothing left to wait for
            pass
        _exit_now(status)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _exit_now(status: int) -> None:
    """Flushes this rank's output and ends its process with ``status``, without the interpreter's teardown of the
    process group (:func:`_close_process_group`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)


def _in_multi_process_group() -> bool:
    """Whether this process is a rank of a torch.distributed group of several (torch not imported: no)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# ------------------------------------------------------------------------------------------------------ errors


def _print_error(error: UserError, prefix: str = "") -> None:
    """``error: <message>`` and ``hint: <hint>`` on standard error, after whatever the run wrote so far."""
    sys.stdout.flush()
    print(error_report(error, prefix), file=sys.stderr)
    sys.stderr.flush()


def _end(err: Exception) -> int:
    """Reports ``err`` as the rules of the module docstring say and returns the exit status; re-raises a bug."""
    error = user_error_in(err)
    rank, store = _rank_and_store()
    if error is None:
        collective = rank is not None and store is not None and _collective_failed(err)
        if collective and rank and not _answers(store):
            return _report_rank0_lost(rank)
        peer = _peer_failed(store, rank)
        if collective and rank and peer is _GONE:  # rank 0 was still going down when _answers connected
            return _report_rank0_lost(rank)
        if peer is not None:
            return USER_ERROR_STATUS  # a consequence of another rank's error, which that rank reported
        if collective:
            status = _report_lost_ranks(store, rank)
            if status is not None:
                return status
        raise err
    if rank is None or rank == 0:
        if store is not None:
            _record(store, 0, error.message)
        _print_error(error)
        _stop_local_ranks()
        return USER_ERROR_STATUS
    if store is None:  # no process group yet: every rank ran the same code, rank 0 reports it
        return USER_ERROR_STATUS
    if not _record(store, rank, error.message):  # rank 0 has ended: it reported its own failure
        return USER_ERROR_STATUS
    rank0 = _wait_for_record(store, 0, PEER_GRACE_S)
    if rank0 is not _GONE and rank0 != error.message:
        _print_error(error, prefix=f"rank {rank}: ")
    return USER_ERROR_STATUS


_GONE = object()  # rank 0's store no longer answers

PEER_LOST_STATUS = 1
_ALIVE_KEY = "draftsmith/alive/"
_COLLECTIVE_FAILURES = ("gloo", "nccl", "connection closed by peer", "connection reset by peer")


def _collective_failed(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it wraps) is a failed collective or store call: torch.distributed's
    ``DistError`` family, or gloo's and the store's connection and timeout errors."""
    try:
        from torch.distributed import DistError
    except ImportError:  # a torch without distributed
        return False
    seen: set[int] = set()
    pending: list[BaseException | None] = [err]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, DistError):
            return True
        if isinstance(current, RuntimeError) and any(s in str(current).lower() for s in _COLLECTIVE_FAILURES):
            return True
        pending += [current.__cause__, current.__context__]
    return False


def _lost_ranks(store, rank: int, world: int):
    """The ranks that did not say they are alive within :data:`PEER_GRACE_S` (every rank whose collective failed
    says so in the store), or ``_GONE`` when the store stopped answering (its host, rank 0, ended)."""
    try:
        store.set(f"{_ALIVE_KEY}{rank}", b"1")
    except Exception:
        return _GONE
    deadline = time.monotonic() + PEER_GRACE_S
    while True:
        try:
            missing = [r for r in range(world) if not store.check([f"{_ALIVE_KEY}{r}"])]
        except Exception:
            return _GONE
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.1)


def _report_lost_ranks(store, rank: int) -> int | None:
    """A collective failed because another rank died, rank 0 alive (its store answers; when it does not, the rank
    ends silently, as on any failure after rank 0 ended): every surviving rank says in the store that it is alive,
    rank 0 prints one line naming the ranks that did not, and every surviving rank ends with
    :data:`PEER_LOST_STATUS`. None when every rank answered: the failure is not a dead rank's."""
    world = int(os.environ.get("WORLD_SIZE", "2") or 2)
    try:
        import torch.distributed as dist

        world = dist.get_world_size()
    except Exception:
        pass
    lost = _lost_ranks(store, rank, world)
    if lost is _GONE:  # rank 0 went down while the others said they were alive
        return _report_rank0_lost(rank) if rank else None
    if not lost:
        return None
    if rank == 0:
        from trainer.training.recipe import DraftsmithCLI

        trainer = DraftsmithCLI.running_trainer
        at = f" at step {trainer.global_step}" if trainer is not None else ""
        names = f"rank {lost[0]}" if len(lost) == 1 else "ranks " + ", ".join(str(r) for r in lost)
        _print_lost(f"error: {names} of {world} stopped answering{at} (its process died or was killed)")
    _stop_local_ranks()
    return PEER_LOST_STATUS


def _answers(store) -> bool:
    """Whether the process group's store still answers: a TCP connection to ``MASTER_ADDR:MASTER_PORT`` where the
    launcher set them (a refused or timed-out one: the host, rank 0, is gone; no store call, whose failure torch
    logs with a C++ stack), else a call to the store."""
    import socket

    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if address and port.isdigit():
        try:
            socket.create_connection((address, int(port)), timeout=PEER_GRACE_S).close()
            return True
        except OSError:
            return False
    try:
        store.check([f"{_ALIVE_KEY}0"])
        return True
    except Exception:  # any failure of the store means its host is gone
        return False


def _report_rank0_lost(rank: int) -> int:
    """A collective failed and rank 0's store no longer answers: rank 0 died (or ended on an error it printed).
    Rank 1 prints one line saying so; every surviving rank ends with :data:`PEER_LOST_STATUS`."""
    if rank == 1:
        from trainer.training.recipe import DraftsmithCLI

        trainer = DraftsmithCLI.running_trainer
        at = f" at step {trainer.global_step}" if trainer is not None else ""
        world = trainer.world_size if trainer is not None else int(os.environ.get("WORLD_SIZE", "2") or 2)
        _print_lost(
            f"error: rank 1: rank 0 of {world} stopped answering{at} (its process died or was killed, unless it "
            "printed an error of its own)"
        )
    _stop_local_ranks()
    return PEER_LOST_STATUS


def _print_lost(error: str) -> None:
    """The lines a surviving rank ends a lost peer with: ``error`` (who stopped answering), then what to do."""
    sys.stdout.flush()
    print(
        f"{error}; the other ranks stop too\nhint: resume with --ckpt_path last: the last complete checkpoint",
        file=sys.stderr,
        flush=True,
    )


def _rank_and_store():
    """(global rank, the process group's key-value store), (rank, None) for a rank of a multi-process run before its
    process group exists, or (None, None) in a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from torch.distributed.distributed_c10d import _get_default_store

            return dist.get_rank(), _get_default_store()
    except Exception:  # no store: judged as before the process group exists
        pass
    if world <= 1:
        return None, None
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return int(getattr(rank_zero_only, "rank", 0) or 0), None


def _record(store, rank: int, message: str) -> bool:
    """Records this rank's error in the store; False when the store no longer answers (rank 0 has ended)."""
    try:
        store.set(f"{_STORE_KEY}{rank}", message.encode())
        return True
    except Exception:  # any failure of the store means its host is gone
        return False


def _wait_for_record(store, rank: int, timeout_s: float):
    """The message ``rank`` recorded, None when it recorded none within ``timeout_s``, or ``_GONE``."""
    key = f"{_STORE_KEY}{rank}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if store.check([key]):
                return store.get(key).decode()
        except Exception:
            return _GONE
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def _peer_failed(store, rank: int | None):
    """``True`` when another rank recorded a user error (this rank's exception is then its consequence), ``_GONE``
    on a rank other than 0 whose store no longer answers (rank 0 has ended), else None."""
    if store is None:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    try:
        import torch.distributed as dist

        world = dist.get_world_size()
    except Exception:
        pass
    try:
        return True if any(store.check([f"{_STORE_KEY}{r}"]) for r in range(world) if r != rank) else None
    except Exception:  # rank 0, the store's host, has ended
        return _GONE if rank != 0 else None


def _stop_local_ranks() -> None:
    """Kills the other local ranks that Lightning's process launcher started, so that none waits in a collective
    for this one (as Lightning does on Ctrl-C)."""
    if "trainer.training.recipe" not in sys.modules:  # no fit ran
        return
    from trainer.training.recipe import DraftsmithCLI

    trainer = DraftsmithCLI.running_trainer
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    if launcher is None or not getattr(launcher, "procs", None) or not hasattr(launcher, "kill"):
        return
    from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal

    launcher.kill(_get_sigkill_signal())


if __name__ == "__main__":
    sys.exit(main())
