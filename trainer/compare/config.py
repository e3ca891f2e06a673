"""The schema of a ``draftsmith compare`` recipe: typed signatures, read by jsonargparse (an unknown or misspelled key
is an error naming it), then checked as a whole (:meth:`CompareConfig.check`).

A recipe names one target, the data every method trains on (or the prompts the target regenerates it from, once), a
training budget, the evaluation, and the methods: each one ``draftsmith fit`` recipe plus its overrides, how to export
it, what ``draftsmith eval`` verifies it against and how it drafts (``options``: the
:class:`~trainer.decoding.options.ProposerOptions` that reach both eval, as its flags, and the training callback, as
data). Strings in a method may name these placeholders: ``{target}`` (the recipe's target), ``{data}`` (the training
files as a JSON list), ``{run}`` (the method's fit folder), ``{ckpt}`` (its ``last.ckpt``) and ``{export}`` (its
export folder).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser

from trainer.decoding.options import ProposerOptions
from trainer.interface.errors import RecipeError

PLACEHOLDERS = ("target", "data", "run", "ckpt", "export")
PLACEHOLDER = re.compile(r"\{([A-Za-z_]\w*)\}")  # {name}; other braces (JSON values) are left as they are
TRAINING_FREE = ("prompt-lookup", "early-exit", "none")  # drafters ``draftsmith eval`` knows by name


class CompareConfigError(RecipeError):
    """A compare recipe that cannot run: the message names the file and the key."""


@dataclass
class Budget:
    """How long each method trains: exactly one of the three.

    Attributes:
        steps: optimizer steps (the recipe's cosine schedule decays over them).
        tokens: training tokens, turned into steps from the recipe's batch size, sequence length, gradient
            accumulation and devices (on-policy and prompt-only objectives count their own tokens in the report).
        seconds: wall-clock seconds (``trainer.max_time``; the learning rate is then constant after warm-up).
    """

    steps: int | None = None
    tokens: int | None = None
    seconds: int | None = None

    def describe(self) -> str:
        if self.steps is not None:
            return f"{self.steps} optimizer steps"
        if self.tokens is not None:
            return f"{self.tokens:,} training tokens"
        return f"{self.seconds} s of training"


@dataclass
class Regenerate:
    """Training data made once by the target itself (``draftsmith generate``, greedy), shared by every method: the
    drafters learn what the target says rather than what the corpus says.

    Attributes:
        documents: jsonl file of ``text`` documents (such as the corpus' training file) the prompts are cut from.
        prompt_chars: characters per prompt.
        prompts_per_document: prompts per document (its start, then random line starts).
        max_new_tokens: tokens the target adds to every prompt.
        batch_size: prompts generated together.
        seed: seed of the random line starts.
    """

    documents: str
    prompt_chars: int = 160
    prompts_per_document: int = 3
    max_new_tokens: int = 192
    batch_size: int = 32
    seed: int = 0


@dataclass
class Data:
    """What every method trains on: the recipes' own files (both None), these files, or regenerated completions.

    Attributes:
        train_files: jsonl files (or folders, globs) that replace every method's ``data.init_args.train_files``.
        regenerate: make the training file from the target's completions instead (see :class:`Regenerate`).
    """

    train_files: list[str] | None = None
    regenerate: Regenerate | None = None


@dataclass
class Evaluation:
    """How every method is measured (``draftsmith eval``, the same prompts and settings for all).

    Attributes:
        prompts: jsonl file of held-out prompts (``prompt``, ``text``, chat ``messages`` or ``input_ids``).
        max_prompts: the first this many prompts.
        prompt_tokens: cut every prompt to its first this many tokens (0: whole).
        k: drafts per round, one evaluation each (a method may give its own).
        max_new_tokens: output tokens per prompt.
        temperature: the sampling mode's temperature (tau greedy and sampling side by side; 0 skips sampling).
        repeats: passes of the side-by-side speedup measurement.
        training_evals: tau is also measured this many times during each fit (SpeculativeEvalCallback on
            ``callback_prompts`` prompts at the method's largest K), for the tau-against-training-tokens plot; 0: off.
        callback_prompts: prompts of those measurements.
        heldout: jsonl of held-out text (such as the corpus' held-out file) the held-out loss of a changed target and
            of the recipe's target is measured on (eval's ``--heldout``); None: the prompts.
        heldout_tokens: score each held-out document's first this many tokens (eval's ``--heldout_tokens``; 0: up
            to the target's context): for a target trained on shorter rows than its config's context, that length.
        context_lengths: also measure every method by context length: a second ``draftsmith eval`` of each, with
            ``--context_lengths`` these lengths on prompts cut from ``context_documents`` (the report's "By context
            length" table and tau_by_context.png); None: off.
        context_documents: jsonl of long documents those prompts are cut from (the first L tokens of every document
            at least L + ``max_new_tokens`` tokens long); None: ``heldout``.
        context_prompts: prompts per context length (eval's ``--max_prompts`` there).
        device: eval's ``--device`` (and ``draftsmith generate``'s for regenerated data).
        target_dtype: eval's ``--target_dtype``: float32, float64, bfloat16 or float16.
    """

    prompts: str
    max_prompts: int = 10
    prompt_tokens: int = 0
    k: list[int] = field(default_factory=lambda: [2, 4])
    max_new_tokens: int = 48
    temperature: float = 1.0
    repeats: int = 1
    training_evals: int = 3
    callback_prompts: int = 4
    heldout: str | None = None
    heldout_tokens: int = 0
    context_lengths: list[int] | None = None
    context_documents: str | None = None
    context_prompts: int = 4
    device: str = "auto"
    target_dtype: str = "float32"

    @property
    def documents(self) -> str | None:
        """The documents the context-length prompts are cut from: ``context_documents``, else ``heldout``."""
        return self.context_documents if self.context_documents is not None else self.heldout


@dataclass
class Method:
    """One row of the comparison.

    Attributes:
        name: the row's label and its folder name under ``OUT/methods/`` (letters, digits, ``-``, ``_``, ``.``).
        recipe: the ``draftsmith fit`` recipe; None for a drafter without training (``drafter: prompt-lookup``).
        fit_args: more ``draftsmith fit`` arguments after the recipe (``--key value`` or ``--key=value``).
        budget: this method's budget (None: the recipe-wide one).
        export_format: the ``draftsmith export --format`` evaluated and reported (None: the kind's default).
        drafter: ``draftsmith eval --drafter`` (default the export; ``{ckpt}`` evaluates the checkpoint).
        eval_target: ``draftsmith eval --target``: the recipe's target, or the trained one for methods that change
            it (``{export}/target`` for Medusa-2, ``{export}`` for LayerSkip and parallel heads fine-tunes).
        options: how the drafter drafts, given to ``draftsmith eval`` (as its flags) and to the training callback
            alike: ``{tree: true, tree_nodes: 16}``, ``{exit_layer: 2}``... (trainer/decoding/options.py).
        k: drafts per round for this method (None: the evaluation's).
    """

    name: str
    recipe: str | None = None
    fit_args: list[str] = field(default_factory=list)
    budget: Budget | None = None
    export_format: str | None = None
    drafter: str = "{export}"
    eval_target: str = "{target}"
    options: ProposerOptions = field(default_factory=ProposerOptions)
    k: list[int] | None = None

    @property
    def trains(self) -> bool:
        return self.recipe is not None


class CompareConfig:
    """A ``draftsmith compare`` recipe (see the module docstring)."""

    def __init__(
        self,
        target: str,
        methods: list[Method],
        evaluation: Evaluation,
        budget: Budget,
        data: Data | None = None,
        output_dir: str = "compare",
        seed: int = 0,
        threads: int = 0,
        machine: str = "",
    ) -> None:
        """
        Args:
            target: the HF target folder every method trains for and is verified against.
            methods: the rows, in the order the report lists them.
            evaluation: the measurement every method gets.
            budget: each method's training budget unless it gives its own (exactly one of steps, tokens, seconds).
            data: what every method trains on (None: each recipe's own files).
            output_dir: output folder: ``report.json``, ``report.md``, plots, and one folder per method.
            seed: ``seed_everything`` of every fit and the sampling seed of every evaluation.
            threads: ``OMP_NUM_THREADS`` of every stage (0: the environment's).
            machine: words about the machine, printed beside every figure (the CPU, GPU count and kind are added).
        """
        self.target, self.methods, self.evaluation = target, methods, evaluation
        self.budget, self.data = budget, data if data is not None else Data()
        self.output_dir, self.seed, self.threads, self.machine = output_dir, seed, threads, machine

    def check(self, where: str) -> None:
        """Every rule the types cannot say, each error naming ``where`` and the key."""
        self._check_budget(self.budget, f"{where}: budget")
        if self.data.train_files is not None and self.data.regenerate is not None:
            raise CompareConfigError(f"{where}: data: give train_files or regenerate, not both")
        if not self.methods:
            raise CompareConfigError(f"{where}: methods: the list is empty")
        for name in (self.evaluation.k, *[m.k for m in self.methods if m.k is not None]):
            if not name or any(k < 1 for k in name):
                raise CompareConfigError(f"{where}: k must be a non-empty list of integers >= 1, got {name}")
        self._check_context(self.evaluation, f"{where}: evaluation")
        seen: set[str] = set()
        for i, method in enumerate(self.methods):
            key = f"{where}: methods[{i}] ({method.name!r})"
            if not re.fullmatch(r"[A-Za-z0-9._-]+", method.name):
                raise CompareConfigError(f"{key}: name must be letters, digits, '-', '_' or '.' (it names a folder)")
            if method.name in seen:
                raise CompareConfigError(f"{key}: a second method of this name")
            seen.add(method.name)
            if method.budget is not None:
                self._check_budget(method.budget, f"{key}: budget")
            if method.recipe is not None and not Path(method.recipe).is_file():
                raise CompareConfigError(f"{key}: recipe {method.recipe!r} not found")
            if method.recipe is None and method.drafter not in TRAINING_FREE:
                raise CompareConfigError(
                    f"{key}: a method without a recipe must name a drafter without weights ({', '.join(TRAINING_FREE)})"
                    f", got drafter {method.drafter!r}"
                )
            for field_name in ("fit_args", "drafter", "eval_target"):
                value = getattr(method, field_name)
                for text in value if isinstance(value, list) else [value]:
                    unknown = sorted(set(PLACEHOLDER.findall(text)) - set(PLACEHOLDERS))
                    if unknown:
                        raise CompareConfigError(
                            f"{key}: {field_name} names {unknown}; the placeholders are {', '.join(PLACEHOLDERS)}"
                        )

    @staticmethod
    def _check_context(evaluation: Evaluation, key: str) -> None:
        lengths = evaluation.context_lengths
        if lengths is None:
            return
        if not lengths or any(n < 1 for n in lengths):
            raise CompareConfigError(f"{key}: context_lengths must be a non-empty list of integers >= 1, got {lengths}")
        if evaluation.documents is None:
            raise CompareConfigError(
                f"{key}: context_lengths {lengths} needs long documents to cut the prompts from: give "
                "context_documents or heldout (a jsonl of held-out text such as artifacts/corpus/heldout.jsonl)"
            )
        if evaluation.context_prompts < 1:
            raise CompareConfigError(f"{key}: context_prompts must be >= 1, got {evaluation.context_prompts}")

    @staticmethod
    def _check_budget(budget: Budget, key: str) -> None:
        given = [(n, v) for n, v in (("steps", budget.steps), ("tokens", budget.tokens), ("seconds", budget.seconds))]
        set_ = [(n, v) for n, v in given if v is not None]
        if len(set_) != 1:
            raise CompareConfigError(f"{key}: give exactly one of steps, tokens or seconds, got {dict(set_) or 'none'}")
        if set_[0][1] < 1:
            raise CompareConfigError(f"{key}: {set_[0][0]} must be >= 1, got {set_[0][1]}")

    def budget_of(self, method: Method) -> Budget:
        return method.budget or self.budget


RENAMED_COMPARE_KEYS = {"out": "output_dir", "evaluation.dtype": "evaluation.target_dtype"}
"""Top-level keys of a compare recipe a release renamed: refused in one line naming the new one."""


def read_config(path: str, overrides: dict | None = None) -> CompareConfig:
    """The compare recipe at ``path`` with top-level ``overrides`` (``{"output_dir": ..., "seed": 1}``), checked."""
    if not Path(path).is_file():
        raise CompareConfigError(f"compare recipe {path!r} not found")
    recipe = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    for old, new in RENAMED_COMPARE_KEYS.items():
        section, _, key = old.rpartition(".")
        where = recipe.get(section) if section and isinstance(recipe, dict) else recipe
        if isinstance(where, dict) and key in where:
            raise CompareConfigError(f"{path}: {old} is now {new}")
    parser = ArgumentParser(exit_on_error=False, prog="draftsmith compare")
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_class_arguments(CompareConfig)
    args = ["--config", path]
    for key, value in (overrides or {}).items():
        args += [f"--{key}", str(value)]
    try:
        namespace = parser.parse_args(args)
        config = parser.instantiate(namespace)
    except (ArgumentError, ValueError) as err:  # ValueError: options out of range (ProposerOptions)
        raise CompareConfigError(f"{path}: {err}") from err
    compare = CompareConfig(**{k: v for k, v in vars(config).items() if k != "config"})
    compare.check(path)
    return compare


def fill_placeholders(text: str, values: dict[str, str]) -> str:
    """``text`` with every ``{name}`` of :data:`PLACEHOLDERS` replaced by its value (other braces kept)."""
    return PLACEHOLDER.sub(lambda m: values[m.group(1)] if m.group(1) in values else m.group(0), text)
