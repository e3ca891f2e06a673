"""The ``draftsmith`` command.

``draftsmith fit --config recipe.yaml [--config more.yaml] [--section.key value ...]`` (and ``validate``) run through
LightningCLI: the objective is chosen by ``model.class_path``, every ``__init__`` signature is the config schema,
unknown or misspelled keys are rejected with the key named, and the resolved config is saved beside the logs and every
checkpoint directory. :func:`parse_recipe` reads a recipe with the same parser without building anything (``draftsmith
plan`` and ``draftsmith slurm submit`` use it). The other subcommands are plain tools, each a module with
``main(argv) -> int``.
"""

from __future__ import annotations

import importlib
import logging
import sys

from trainer.recipe import DraftsmithCLI

# Subcommands that are tools rather than training runs: name -> "module:function", function(argv) -> exit code.
TOOLS: dict[str, tuple[str, str]] = {
    "prepare": ("trainer.data.corpus:main", "build the bundled corpus and train its tokenizer"),
    "demo": ("trainer.demo:main", "prepare, train a tiny target, distil a student, evaluate both"),
    "eval": ("trainer.decoding.eval_cli:main", "measure a drafter with lossless speculative decoding"),
    "compare": ("trainer.compare.run:main", "train every method on one target, measure all with one engine, report"),
    "export": ("trainer.export.cli:main", "write a trained drafter in a serving engine's format"),
    "precompute": ("trainer.data.precompute:main", "write the target's top-k logits and hidden states to shards"),
    "generate": ("trainer.data.generate:main", "regenerate a chat data set's responses with the target"),
    "slurm": ("trainer.slurm:main", "render and submit an sbatch script for a recipe"),
    "plan": ("trainer.planner:main", "estimate memory per GPU for each ZeRO stage"),
}


def _usage() -> str:
    tools = "\n".join(f"  {name:<10} {help_}" for name, (_, help_) in TOOLS.items())
    return (
        "usage: draftsmith <command> [options]\n\ntraining (LightningCLI; see `draftsmith fit --help`):\n"
        "  fit        train with a recipe: draftsmith fit --config recipes/quickstart/kd.yaml\n"
        f"  validate   evaluate the validation loss of a recipe's model\n\ntools:\n{tools}\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if args[0] in TOOLS:
        module_name, function_name = TOOLS[args[0]][0].split(":")
        return int(getattr(importlib.import_module(module_name), function_name)(args[1:]) or 0)
    if args[0] not in ("fit", "validate"):
        print(f"draftsmith: unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    DraftsmithCLI(args=argv)  # None: LightningCLI reads sys.argv, as its subprocess launchers expect
    return 0


if __name__ == "__main__":
    sys.exit(main())
