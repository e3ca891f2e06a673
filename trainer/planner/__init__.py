"""``draftsmith plan``: memory per GPU (or per CPU process) of any recipe under DDP and DeepSpeed ZeRO 1, 2 and 3.

:mod:`trainer.planner.cli` reads the recipe and prints the table; :mod:`trainer.planner.build` builds the objective on
the meta device and counts its tensors; the objective estimates its own step's activations
(``DraftObjective.activation_bytes``, written with :mod:`trainer.training.activation_memory`);
:mod:`trainer.planner.shapes` holds the presets and the ZeRO accounting.
"""

from trainer.planner.cli import (
    CPU_RUNTIME_BYTES,
    Plan,
    build_parser,
    main,
    markdown_table,
    parse_bytes,
    plan_from_recipe,
)
from trainer.planner.shapes import (
    PRESETS,
    Counts,
    Estimate,
    Shape,
    drafter_activation_bytes,
    estimate,
    estimate_counts,
    precision_bytes,
)

__all__ = [
    "CPU_RUNTIME_BYTES",
    "PRESETS",
    "Counts",
    "Estimate",
    "Plan",
    "Shape",
    "build_parser",
    "drafter_activation_bytes",
    "estimate",
    "estimate_counts",
    "main",
    "markdown_table",
    "parse_bytes",
    "plan_from_recipe",
    "precision_bytes",
]
