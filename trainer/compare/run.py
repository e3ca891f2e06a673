"""``draftsmith compare --config RECIPE``: every method on one target, trained under one budget, measured by one engine,
in one report.

For every method of the recipe (trainer/compare/config.py), each stage skipped when its output exists, so a rerun
only does what is missing (an interrupted fit resumes from its ``last.ckpt``):

1. the shared training data, once: the target's greedy completions of prompts cut from documents
   (``draftsmith generate``), unless the recipe gives the files;
2. ``draftsmith fit`` of the method's recipe under its budget, with SpeculativeEvalCallback measuring tau a few times
   on held-out prompts (tau against training tokens);
3. ``draftsmith export`` in the method's format;
4. the drafter's footprint: its parameters, and the bytes of those the target does not already hold (what serving it
   adds to the target's weights);
5. ``draftsmith eval`` on the same held-out prompts for every method: tau greedy and sampling, inside and outside the
   target's loops, acceptance per position, drafting cost, side-by-side measured and projected speedup; for a method
   that changed its target, also that target's held-out loss and loop share beside the recipe's target
   (``--original_target``);
6. with ``evaluation.context_lengths``, a second ``draftsmith eval`` by context length (``--context_lengths``) on
   prompts cut from long documents (``eval_context/``), for the report's "By context length" table.

Every stage runs in its own process with its output in a log beside its results. A method whose stage fails is
reported with the log's last lines and the others go on; the next run retries it. Then ``OUT/report.json``,
``OUT/report.md`` and the plots (trainer/compare/report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from trainer.compare.config import CompareConfig, CompareConfigError, Method, fill_placeholders, read_config
from trainer.data.corpus import training_prompts
from trainer.decoding.options import option_arguments
from trainer.interface.errors import UserError, debugging, error_report
from trainer.interface.flags import ToolParser
from trainer.interface.output import block, duration

FIT_TAGS = ("train/tokens", "spec_eval/tau", "spec_eval/tau_sampling")


class StageFailed(RuntimeError):
    """A stage of one method failed; the comparison goes on with the other methods."""

    def __init__(self, stage: str, message: str, log: Path | None = None) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage, self.message, self.log = stage, message, log


@dataclass(frozen=True)
class MethodFolder:
    """Where one method's stages write (``OUT/methods/NAME``)."""

    root: Path

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def ckpt(self) -> Path:
        return self.run / "checkpoints" / "last.ckpt"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def eval_context(self) -> Path:
        return self.root / "eval_context"

    def file(self, name: str) -> Path:
        return self.root / name


class Comparison:
    """Runs the stages of every method of one compare recipe into ``config.output_dir``."""

    def __init__(self, config: CompareConfig, recipe: str) -> None:
        self.config, self.recipe = config, recipe
        self.out = Path(config.output_dir)
        self.env = dict(os.environ)
        if config.threads > 0:
            self.env["OMP_NUM_THREADS"] = str(config.threads)
        self.train_files: list[str] | None = None  # None: every recipe keeps its own
        if config.data.train_files is not None:
            self.train_files = list(config.data.train_files)
        elif config.data.regenerate is not None:
            self.train_files = [str(self.out / "data" / "train_completions.jsonl")]

    def check_methods(self) -> None:
        """Every training method's recipe and fit arguments, read by fit's own parser (nothing built, no file read):
        a misspelled key stops the comparison before anything runs, naming the method."""
        from trainer.training.recipe import RecipeError, parse_recipe

        for i, method in enumerate(self.config.methods):
            if method.trains:
                try:
                    parse_recipe([method.recipe], self.fit_args(method))
                except RecipeError as err:
                    raise CompareConfigError(f"{self.recipe}: methods[{i}] ({method.name!r}): {err}") from err

    def check_context(self) -> None:
        """``evaluation.context_lengths`` against the recipe's target and the documents, cut as eval will cut them: a
        length the target's context cannot hold beside ``max_new_tokens``, or that no document is long enough for,
        stops the comparison before anything runs."""
        evaluation = self.config.evaluation
        if not evaluation.context_lengths:
            return
        from transformers import AutoConfig, AutoTokenizer

        from trainer.decoding.context import cut_buckets
        from trainer.decoding.evaluate import load_prompts

        target = self.config.target
        context = getattr(AutoConfig.from_pretrained(target), "max_position_embeddings", None)
        try:
            documents = load_prompts(evaluation.documents, AutoTokenizer.from_pretrained(target), None)
            cut_buckets(
                documents, evaluation.context_lengths, evaluation.max_new_tokens,
                context - evaluation.max_new_tokens if context else None, 1, evaluation.documents,
                "evaluation.context_lengths", "evaluation.max_new_tokens",
            )  # fmt: skip
        except UserError as err:
            raise CompareConfigError(f"{self.recipe}: {err.message}", hint=err.hint) from err
        except (OSError, ValueError) as err:
            raise CompareConfigError(f"{self.recipe}: evaluation.context_lengths: {err}") from err

    # ---- stages shared by every method -----------------------------------------------------------------------
    def prepare(self) -> None:
        """Checks the target, the prompts and every method's fit arguments (with fit's own parser: a misspelled key
        stops the comparison before anything runs), then makes the shared training data."""
        self.out.mkdir(parents=True, exist_ok=True)
        if not (Path(self.config.target) / "config.json").is_file():
            raise CompareConfigError(f"{self.recipe}: target {self.config.target!r} is not a model folder")
        for key in ("prompts", "heldout", "context_documents"):
            path = getattr(self.config.evaluation, key)
            if path is not None and not Path(path).is_file():
                raise CompareConfigError(f"{self.recipe}: evaluation.{key} {path!r} not found")
        self.check_context()
        self.check_methods()
        data = self.config.data
        if data.regenerate is not None:
            self._regenerate(Path(self.train_files[0]))

    def _regenerate(self, done: Path) -> None:
        """The target's greedy completions of prompts cut from the documents, once, into ``done``."""
        if done.is_file():
            return
        regen = self.config.data.regenerate
        done.parent.mkdir(parents=True, exist_ok=True)
        prompts = done.parent / "train_prompts.jsonl"
        if not prompts.is_file():  # kept: an interrupted generation resumes on the same input
            training_prompts(Path(regen.documents), prompts, regen.prompt_chars, regen.prompts_per_document, regen.seed)
        count = len(prompts.read_text(encoding="utf-8").splitlines())
        partial = done.parent / "train_completions.partial.jsonl"
        self.say(f"data: the target completes {count} prompts ({regen.max_new_tokens} tokens each, greedy)")
        options = {
            "--target": self.config.target, "--input_file": str(prompts), "--output_file": str(partial),
            "--prompt_field": "prompt", "--max_new_tokens": str(regen.max_new_tokens),
            "--batch_size": str(regen.batch_size), "--device": self.config.evaluation.device,
        }  # fmt: skip
        self._run_stage(
            "data", ["generate", *[x for pair in options.items() for x in pair]], done.parent / "generate.log"
        )
        partial.rename(done)

    # ---- one method ------------------------------------------------------------------------------------------
    def folder(self, method: Method) -> MethodFolder:
        return MethodFolder(self.out / "methods" / method.name)

    def expand(self, method: Method, text: str) -> str:
        """A method string with its placeholders filled in."""
        folder = self.folder(method)
        return fill_placeholders(
            text,
            {
                "target": self.config.target,
                "data": json.dumps(self.train_files) if self.train_files is not None else "null",
                "run": str(folder.run),
                "ckpt": str(folder.ckpt),
                "export": str(folder.export),
            },
        )

    def fit_args(self, method: Method) -> list[str]:
        """The comparison's seed (``seed_everything``, the objective's initialisation and the data order: every
        objective and datamodule takes a ``seed``), the method's fit arguments with their placeholders filled in
        (they may set their own seeds), and the shared training files."""
        seed = str(self.config.seed)
        args = ["--seed_everything", seed, "--model.init_args.seed", seed, "--data.init_args.seed", seed]
        args += [self.expand(method, a) for a in method.fit_args]
        if self.train_files is not None:
            args += ["--data.init_args.train_files", json.dumps(self.train_files)]
        return args

    def run_method(self, method: Method) -> None:
        """Every stage of ``method`` not done yet; raises :class:`StageFailed`. The seconds of each stage run go to
        ``stage_seconds.json`` (fit: all its attempts)."""
        folder = self.folder(method)
        folder.root.mkdir(parents=True, exist_ok=True)
        folder.file("failed.json").unlink(missing_ok=True)
        stages = []
        if method.trains:
            stages += [("fit", folder.file("fit.json"), self.fit), ("export", folder.file("export.json"), self.export)]
        stages += [
            ("footprint", folder.file("footprint.json"), self.measure_footprint),
            ("eval", folder.eval / "report.json", self.evaluate),
        ]
        if self.config.evaluation.context_lengths:
            stages.append(("eval_context", folder.eval_context / "report.json", self.evaluate_context))
        seconds_file = folder.file("stage_seconds.json")
        for stage, done, run in stages:
            if done.is_file():
                continue
            started = time.perf_counter()
            try:
                run(method, folder)
            finally:
                seconds = json.loads(seconds_file.read_text()) if seconds_file.is_file() else {}
                seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - started
                seconds_file.write_text(json.dumps(seconds, indent=2) + "\n")

    def measure_footprint(self, method: Method, folder: MethodFolder) -> None:
        from trainer.compare.footprint import footprint

        try:
            record = footprint(self.expand(method, method.drafter), self.expand(method, method.eval_target))
        except (OSError, ValueError) as err:
            raise StageFailed("footprint", str(err)) from err
        folder.file("footprint.json").write_text(json.dumps(record, indent=2) + "\n")

    def fit(self, method: Method, folder: MethodFolder) -> None:
        from trainer.compare.fit_logs import loss_of, read_scalars, steps_for_budget

        budget = self.config.budget_of(method)
        fit_args = self.fit_args(method)
        try:
            steps = steps_for_budget(budget, method.recipe, fit_args)
        except ValueError as err:
            raise StageFailed("fit", str(err)) from err
        evaluation = self.config.evaluation
        ks = method.k or evaluation.k
        interval = max(1, steps // 4) if steps else 50
        callbacks = [
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {
                    "dirpath": str(folder.run / "checkpoints"), "every_n_train_steps": interval, "save_top_k": 0,
                    "save_last": True,
                },
            }
        ]  # fmt: skip
        if evaluation.training_evals > 0:
            callbacks.append(
                {
                    "class_path": "trainer.decoding.callback.SpeculativeEvalCallback",
                    "init_args": {
                        "prompts": evaluation.prompts, "prompt_tokens": evaluation.prompt_tokens, "k": max(ks),
                        "max_new_tokens": evaluation.max_new_tokens, "max_prompts": evaluation.callback_prompts,
                        "every_n_steps": max(1, steps // evaluation.training_evals) if steps else 100,
                        "temperature": evaluation.temperature, "seed": self.config.seed,
                        "options": asdict(method.options),
                    },
                }
            )  # fmt: skip
        logger = {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {"save_dir": str(folder.run), "name": "tensorboard"},
        }
        length = ["--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps)]
        if steps is None:  # a wall-clock budget: a constant learning rate (there is no step count to decay over)
            hms = time.strftime("%H:%M:%S", time.gmtime(budget.seconds))
            length = ["--trainer.max_steps", "-1", "--trainer.max_time", f"00:{hms}"]
            length += ["--model.init_args.optim.decay", "constant"]
        args = [
            "fit", "--config", method.recipe, *fit_args, *length,
            "--trainer.default_root_dir", str(folder.run), "--trainer.logger", json.dumps(logger),
            "--trainer.callbacks", json.dumps(callbacks), "--trainer.enable_progress_bar", "false",
        ]  # fmt: skip
        if folder.ckpt.is_file():
            args += ["--ckpt_path", "last"]
        self.say(f"{method.name}: fit, {budget.describe()}{f' ({steps} steps)' if steps else ''}")
        self._run_stage("fit", args, folder.root / "fit.log")
        scalars = read_scalars(folder.run / "tensorboard", FIT_TAGS)
        tokens = scalars.get("train/tokens", {})
        record = {
            "budget": budget.describe(),
            "loss": loss_of(method.recipe, fit_args),
            "steps": max(tokens) if tokens else steps,
            "tokens": tokens[max(tokens)] if tokens else None,
            "scalars": {tag: sorted(values.items()) for tag, values in scalars.items()},
        }
        folder.file("fit.json").write_text(json.dumps(record, indent=2) + "\n")

    def export(self, method: Method, folder: MethodFolder) -> None:
        args = ["export", "--ckpt_path", str(folder.ckpt), "--output_dir", str(folder.export)]
        if method.export_format:
            args += ["--format", method.export_format]
        self.say(f"{method.name}: export{f' ({method.export_format})' if method.export_format else ''}")
        self._run_stage("export", args, folder.root / "export.log")
        folder.file("export.json").write_text(json.dumps({"format": method.export_format}) + "\n")

    def eval_arguments(self, method: Method, folder: MethodFolder) -> list[str]:
        """``draftsmith eval``'s arguments every evaluation of ``method`` shares: target, drafter, K, output budget,
        sampling, passes, seed, device, target dtype and the drafting options."""
        evaluation = self.config.evaluation
        return [
            "eval", "--target", self.expand(method, method.eval_target),
            "--drafter", self.expand(method, method.drafter),
            "--k", ",".join(map(str, method.k or evaluation.k)), "--max_new_tokens", str(evaluation.max_new_tokens),
            "--temperature", str(evaluation.temperature), "--repeats", str(evaluation.repeats),
            "--seed", str(self.config.seed), "--device", evaluation.device, "--target_dtype", evaluation.target_dtype,
            *option_arguments(method.options, folder.root),
        ]  # fmt: skip

    def evaluate_context(self, method: Method, folder: MethodFolder) -> None:
        """``draftsmith eval --context_lengths`` of ``method`` on prompts cut from the evaluation's documents."""
        evaluation = self.config.evaluation
        args = self.eval_arguments(method, folder)
        args += ["--prompts", str(evaluation.documents), "--max_prompts", str(evaluation.context_prompts)]
        args += ["--context_lengths", ",".join(map(str, evaluation.context_lengths or []))]
        args += ["--output_dir", str(folder.eval_context)]
        self.say(f"{method.name}: eval by context length, {', '.join(map(str, evaluation.context_lengths or []))}")
        self._run_stage("eval_context", args, folder.root / "eval_context.log")

    def evaluate(self, method: Method, folder: MethodFolder) -> None:
        evaluation = self.config.evaluation
        ks = method.k or evaluation.k
        args = self.eval_arguments(method, folder)
        args += ["--prompts", evaluation.prompts, "--max_prompts", str(evaluation.max_prompts)]
        args += ["--prompt_tokens", str(evaluation.prompt_tokens), "--output_dir", str(folder.eval)]
        if method.eval_target != "{target}":  # a changed target: measured beside the recipe's target, its original
            args += ["--original_target", self.config.target]
            args += ["--heldout", evaluation.heldout] if evaluation.heldout else []
            args += ["--heldout_tokens", str(evaluation.heldout_tokens)] if evaluation.heldout_tokens else []
        self.say(f"{method.name}: eval, K = {', '.join(map(str, ks))}")
        self._run_stage("eval", args, folder.root / "eval.log")

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _run_stage(self, stage: str, args: list[str], log: Path) -> None:
        """``draftsmith ARGS`` in a process of its own, its command line and output in ``log``."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as handle:
            handle.write("$ draftsmith " + " ".join(args) + "\n")
            handle.flush()
            status = self._run_command(args, handle)
        if status != 0:
            raise StageFailed(stage, f"draftsmith {args[0]} exited with status {status}", log)

    def _run_command(self, args: list[str], output: IO[str]) -> int:
        """``draftsmith ARGS`` in a fresh process (this Python's), standard output and error to ``output``; its exit
        status."""
        command = [sys.executable, "-m", "trainer.cli", *args]
        return subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, env=self.env).returncode

    def say(self, text: str) -> None:
        print(f"[compare {time.strftime('%H:%M:%S')}] {text}", flush=True)


def log_tail(log: Path | None, lines: int = 15) -> str:
    if log is None or not log.is_file():
        return ""
    return "".join(log.read_text(errors="replace").splitlines(True)[-lines:])


class OneRecipe(argparse.Action):
    """``--config`` given once: a compare recipe does not compose with another (a second one silently replaced the
    first), so a second is refused in one line."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = getattr(namespace, self.dest, None)
        if given is not None:
            parser.exit(2, f"{parser.prog}: one --config (a compare recipe), got {given} and {values}\n")
        setattr(namespace, self.dest, values)


def build_parser() -> ToolParser:
    """The parser of ``draftsmith compare``."""
    parser = ToolParser(prog="draftsmith compare", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--config", required=True, action=OneRecipe, help="a compare recipe (recipes/compare/*.yaml); one only"
    )
    parser.add_argument("--output_dir", help="output folder (default: the recipe's output_dir)")
    parser.add_argument("--seed", type=int, help="seed of every fit and evaluation (default: the recipe's seed)")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS of every stage (default: the recipe's threads)")
    parser.add_argument("--only", help="run only these methods (names separated by commas); the report lists all done")
    parser.add_argument(
        "--stability",
        help="the output folder of the same comparison run with another seed: the report counts the pairwise "
        "orderings of methods that flip between the two runs",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``draftsmith compare``; returns the exit status (1 when a method failed)."""
    from trainer.compare.report import write_report

    args = build_parser().parse_args(argv)
    given = (("output_dir", args.output_dir), ("seed", args.seed), ("threads", args.threads))
    overrides = {key: value for key, value in given if value is not None}
    started = time.perf_counter()  # the comparison's wall time, the shared data included
    try:
        config = read_config(args.config, overrides)
        comparison = Comparison(config, args.config)
        comparison.prepare()
    except UserError as err:  # the compare recipe, a method's fit arguments, the target, the prompts
        if debugging():
            raise
        print(error_report(err), file=sys.stderr)
        return 2
    except (ValueError, StageFailed) as err:  # making the shared data failed
        print(f"error: {err}", file=sys.stderr)
        return 1
    names = [m.name for m in config.methods]
    only = set(args.only.split(",")) if args.only else set(names)
    unknown = sorted(only - set(names))
    if unknown:
        print(f"error: --only names {unknown}; the recipe's methods are {', '.join(names)}", file=sys.stderr)
        return 2
    failures = 0
    for number, method in enumerate(config.methods, 1):
        if method.name not in only:
            continue
        comparison.say(f"[{number}/{len(names)}] {method.name}")
        try:
            comparison.run_method(method)
        except StageFailed as err:
            failures += 1
            record = {"stage": err.stage, "error": err.message, "log": str(err.log or ""), "tail": log_tail(err.log)}
            comparison.folder(method).file("failed.json").write_text(json.dumps(record, indent=2) + "\n")
            comparison.say(f"{method.name}: FAILED at {err.stage} ({err.message}); see {err.log or 'above'}")
    seconds_file = comparison.out / "compare_seconds.json"
    history = json.loads(seconds_file.read_text()) if seconds_file.is_file() else []
    history.append(time.perf_counter() - started)
    seconds_file.write_text(json.dumps(history) + "\n")
    try:
        paths = write_report(config, comparison.out, Path(args.stability) if args.stability else None)
    except FileNotFoundError as err:
        print(error_report(err), file=sys.stderr)
        return 2
    ran = len(only & set(names))
    failed = f", {failures} failed (failed.json in their folders)" if failures else ""
    rows = [("methods", f"{ran - failures} of {ran} done{failed}"), ("report", "\n".join(str(p) for p in paths))]
    other = config.seed + 1  # the same comparison at another seed: which orderings of methods hold
    rerun = f"draftsmith compare --config {args.config} --seed {other} --output_dir {comparison.out}_seed{other}"
    title = f"compare done in {duration(time.perf_counter() - started)}"
    print(block(title, rows, [f"{rerun} --stability {comparison.out}"]), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
