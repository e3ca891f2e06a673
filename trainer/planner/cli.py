"""``draftsmith plan``: bytes per GPU of a distillation recipe under DDP and DeepSpeed ZeRO 1, 2 and 3.

    draftsmith plan --config recipes/quickstart/kd.yaml --gpus 8 --gpu_memory 80GB [--target llama-3-8b] [-- FIT ARGS]

The recipe is parsed as ``draftsmith fit`` parses it (:func:`trainer.training.recipe.parse_recipe`: the same
``--config`` composition, the same errors for unknown keys, the signatures' defaults filled in; fit arguments go after
``--``), and nothing is instantiated: the target's config comes from
``AutoConfig.from_pretrained(model.init_args.target)`` (or ``--target DIR|config.json|HUB_ID``, or a built-in
``--target`` preset for the Llama 3 shapes, no hub needed), the drafter is the target's config with
``model.init_args.drafter_config`` applied (as the KD objective builds it) or ``model.init_args.drafter``'s config,
batch and sequence come from ``data.init_args`` (a ShardDataModule's sequence length from its shards' manifest), chunk
size from ``model.init_args.loss_chunk_size`` and precision from ``trainer.precision``. Data of mixed lengths
(``data.init_args.long_seq_len`` with a ``long_fraction`` above 0) is planned at its step of larger activations:
``batch_size`` rows of ``seq_len``, or ``batch_size / k`` rows of ``long_seq_len`` (k = long_seq_len / seq_len);
``--batch_size`` or ``--seq_len`` plans exactly the step they name.

What is counted, per GPU, for N GPUs (the ZeRO paper's accounting, Adam/AdamW):

* target weights: P_t x (4 bytes for 32-true, else 2); frozen, whole on every rank, except under ZeRO-3, which
  partitions every parameter of the module (the frozen target included) and gathers one layer at a time;
* drafter weights: P_d x w (w = 4 for 32-true, 2 for bf16/16 precisions); divided by N under ZeRO-3;
* gradients: P_d x w; divided by N under ZeRO-2 and 3;
* optimizer states: P_d x K, K = 8 (two fp32 moments) plus 4 for the fp32 master weights under mixed precision, and
  under every ZeRO stage (DeepSpeed keeps an fp32 master copy of its partition even of an fp32 model); divided by N
  under ZeRO-1, 2 and 3;
* buffers: AdamW's step temporary (torch's foreach update takes the square root of every second moment into new
  tensors: one copy of the parameters it updates, P_d x 4 / N under ZeRO); DeepSpeed's fp32 gradient of the
  optimizer's partition (P_d x 4 / N), and under ZeRO-1 and 2 its two gradient buckets of ``reduce_bucket_size``
  (Lightning's 2e8 elements; fp32 under ZeRO-1, the gradients' dtype under ZeRO-2);
* activations: the objective's own estimate of one step, ``activation_bytes`` (trainer/training/activation_memory.py),
  the peak of the target's forward under no_grad and the trained part's forward and backward: per trained layer B x S x
  (10 H + 4 I + 2 H_kv) x a bytes saved for backward (a = 4 for 32-true, else 2), the S x S scores per head of a drafter
  attention that is not fused (``attention: dense``, or ``auto`` on CPU: the GPU rows plan ``auto`` as flex, the
  ``--cpu`` line as dense), the target's attention mask (or an eager target's scores), what the target hands over, and a
  chunked loss's float32 chunks. An objective without an estimate is refused by name. ``--sequence_parallel P`` plans
  DeepSpeed-Ulysses (trainer/distributed/sequence_parallel.py) for an objective that declares
  ``plans_sequence_parallel`` (EAGLE-3): each GPU holds S / P positions and attends over the whole row with 1 / P of
  the heads, as ``model.sequence_parallel`` (the default of the flag) runs it in ``draftsmith fit``.

The total is the sum but for ZeRO's step-only buffers (the fp32 partition gradient and AdamW's temporary, built in
the optimizer step after backward has freed the activations): a ZeRO row counts the larger of those and the
activations. The DDP row keeps the sum: the rehearsal measured its single-process fits at or above it.

Not counted: NCCL workspaces, allocator fragmentation and the CUDA context, usually 1 to 3 GB per GPU; ``--reserve``
subtracts an allowance (default 3 GB) from the GPU memory before deciding what fits. tests/unit/test_planner.py checks
the parameter, gradient and optimizer counts exactly and the activation estimate against tensors measured on CPU for
the tiny recipes; ``make rehearse`` compares the estimate of one CPU process (``--cpu``, the row of the recipe's
strategy) with the peak of real-width fits (docs/benchmarks/rehearsal.md).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.interface.errors import (
    DataError,
    ModelFolderError,
    RecipeError,
    UsageError,
    UserError,
    debugging,
    error_report,
)
from trainer.interface.flags import ToolParser
from trainer.planner.build import build_objective, count
from trainer.planner.shapes import GIB, PRESETS, Counts, Estimate, Shape, estimate_counts
from trainer.training.activation_memory import PlannedStep

# Resident memory of a `draftsmith fit` process before its model is built: 445 MiB measured after importing torch
# 2.13 (CPU), Lightning, transformers 5.24 and an objective, rounded up for the trainer, tokenizer and data loader.
CPU_RUNTIME_BYTES = 512 * 1024**2

# ------------------------------------------------------------------------------------------------- recipe reading


def _load_config(source: str) -> dict[str, Any]:
    """An HF config as a dict: a config.json file, a model folder, or a hub id (AutoConfig)."""
    path = Path(source)
    if path.is_file():
        return json.loads(path.read_text())
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text())
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source).to_dict()
    except (OSError, ValueError) as err:
        raise ModelFolderError(
            f"draftsmith plan: cannot read the config of {source!r} ({err}); pass --target with a model folder, a "
            f"config.json file or a preset ({', '.join(PRESETS)})"
        ) from err


@dataclass(frozen=True)
class Plan:
    """What :func:`plan_from_recipe` read from a recipe and counted on its objective built on the meta device."""

    target: Shape | None
    drafter: Shape | None
    batch: int
    seq: int
    precision: str
    chunk_size: int | None
    counts: Counts
    activations: int
    stage: str = "ddp"  # the row of the recipe's trainer.strategy: zero1-3 for DeepSpeed, else ddp
    cpu_activations: int | None = None  # the same step on CPU (dense attention); None: as on the GPUs
    sequence_parallel: int = 1  # ranks sharing each row (DeepSpeed-Ulysses)

    def estimates(self, gpus: int, cpu: bool = False) -> list[Estimate]:
        """Bytes per GPU (per process) for DDP and ZeRO 1-3; ``cpu``: per CPU process (a drafter's attention dense)."""
        activations = self.cpu_activations if cpu and self.cpu_activations is not None else self.activations
        return estimate_counts(self.counts, activations, gpus, self.precision)


def plan_from_recipe(
    configs: list[str],
    target: str | None = None,
    target_config: str | None = None,
    batch: int | None = None,
    seq: int | None = None,
    precision: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    sequence_parallel: int | None = None,
) -> Plan:
    """Read the target, batch, sequence and precision from a recipe and build its objective on the meta device.

    Args:
        configs: recipe YAMLs in --config order.
        target: a preset name (see PRESETS) instead of the recipe's target.
        target_config: an HF config.json or model folder instead of the recipe's target.
        batch: overrides data.init_args.batch_size.
        seq: overrides data.init_args.seq_len.
        precision: overrides trainer.precision.
        overrides: more ``draftsmith fit`` arguments, applied after the configs as fit applies them.
        sequence_parallel: ranks sharing each row under DeepSpeed-Ulysses (trainer/distributed/sequence_parallel.py);
            None: the recipe's ``model.sequence_parallel`` (1 without one); an objective that does not declare
            ``plans_sequence_parallel`` is refused above 1.

    Raises:
        trainer.training.recipe.RecipeError: a recipe or override ``draftsmith fit`` would refuse (fit's message).
        UserError: a recipe the objective refuses, or a target config the planner cannot read.
    """
    from trainer.training.recipe import parse_recipe

    recipe = parse_recipe(configs, overrides)
    if recipe.get("model") is None:
        raise RecipeError("draftsmith plan: the recipe has no model")
    model = recipe.model.init_args
    data = recipe.get("data.init_args")
    target_dict: dict[str, Any] | None
    if target is not None:
        if target not in PRESETS:
            raise UsageError(f"draftsmith plan: unknown --target {target!r}; presets: {', '.join(PRESETS)}")
        target_dict = dict(PRESETS[target], model_type="llama")
        source = f"preset {target}"
    elif target_config is not None:
        target_dict, source = _load_config(target_config), target_config
    elif model.get("target"):
        target_dict, source = _load_config(str(model.target)), str(model.target)
    else:
        target_dict, source = None, "none"  # a model trained from scratch (its config is in the recipe)
    drafter_shape = None
    if target_dict is not None and "drafter_config" in model and not model.get("drafter"):
        drafter_config = dict(model.drafter_config or {})
        drafter_dict = dict(target_dict)
        for key, value in drafter_config.items():
            if key not in drafter_dict and key not in ("head_dim", "tie_word_embeddings", "num_key_value_heads"):
                raise RecipeError(f"draftsmith plan: model.init_args.drafter_config: {key!r} is not a key of {source}")
            drafter_dict[key] = value
        if "hidden_size" in drafter_config and "head_dim" not in drafter_config:
            drafter_dict.pop("head_dim", None)  # follows the new width, as in the HF config
        drafter_shape = Shape.from_config(drafter_dict, "the drafter config")
    if data is None:
        raise RecipeError("draftsmith plan: the recipe has no data")
    steps_given = batch is not None or seq is not None
    if batch is None:
        if "batch_size" not in data:
            raise RecipeError("draftsmith plan: the recipe's data has no init_args.batch_size; pass --batch_size")
        batch = data.batch_size
    if seq is None:
        seq = _seq_len(data)
    if precision is None:
        # trainer.precision's default, None, is 32-true in Lightning's accelerator connector
        precision = recipe.trainer.precision if recipe.trainer.precision is not None else "32-true"
    chunk = model.get("loss_chunk_size")
    # a recipe without a target trains a fresh model from its own config: --target does not apply
    objective = build_objective(recipe.model.class_path, model, target_dict if model.get("target") else None)
    steps = [(int(batch), int(seq))]
    if not steps_given and data.get("long_seq_len") and data.get("long_fraction"):  # mixed lengths: the longest rows
        steps.append((int(batch) * int(seq) // int(data.long_seq_len), int(data.long_seq_len)))
    if sequence_parallel is None:
        sequence_parallel = int(objective.sequence_parallel)  # the recipe's (DraftObjective's default: 1)
    if sequence_parallel != 1:
        _check_sequence_parallel(objective, sequence_parallel, steps)
    planned = [
        (objective.activation_bytes(PlannedStep.of(objective, b, s, str(precision), chunk, "cuda", sequence_parallel)),
         b, s)
        for b, s in steps
    ]  # fmt: skip
    activations, batch, seq = max(planned, key=lambda p: (p[0], p[2]))  # larger activations; the long on a tie
    cpu_step = PlannedStep.of(objective, batch, seq, str(precision), chunk, "cpu", sequence_parallel)
    text = None if target_dict is None else target_dict.get("text_config", target_dict)
    return Plan(
        target=Shape.from_config(text, source) if text is not None and model.get("target") else None,
        drafter=drafter_shape,
        batch=batch,
        seq=seq,
        precision=str(precision),
        chunk_size=None if chunk is None else int(chunk),
        counts=count(objective),
        activations=activations,
        stage=strategy_stage(recipe.trainer.get("strategy")),
        cpu_activations=objective.activation_bytes(cpu_step),
        sequence_parallel=sequence_parallel,
    )


def _check_sequence_parallel(objective: Any, size: int, steps: list[tuple[int, int]]) -> None:
    """Refuses ``--sequence_parallel size`` for an objective whose estimate does not plan it (its class does not
    declare ``plans_sequence_parallel``), and a degree Ulysses cannot run on its attention or rows."""
    from trainer.distributed.sequence_parallel import check_sequence_parallel

    name = type(objective).__name__
    if not type(objective).__dict__.get("plans_sequence_parallel", False):
        raise UsageError(f"draftsmith plan: --sequence_parallel {size}: {name} does not plan sequence parallelism")
    heads = [Shape.of(objective.target_config).num_key_value_heads]
    drafter = getattr(getattr(objective, "drafter", None), "config", None)
    heads += [drafter.num_key_value_heads] if hasattr(drafter, "num_key_value_heads") else []
    for kv in heads:
        for _, seq in steps:
            check_sequence_parallel(size, kv, seq, "draftsmith plan --sequence_parallel")


def strategy_stage(strategy: Any) -> str:
    """The estimate row of a recipe's ``trainer.strategy``: ``zeroN`` for DeepSpeed (a class path naming DeepSpeed, its
    ``init_args.stage``, Lightning's default 2; or a ``deepspeed_stage_N`` name), else ``ddp`` (DDP, and FSDP2 in one
    process, hold what DDP holds)."""
    if isinstance(strategy, str):
        match = re.fullmatch(r"deepspeed(?:_stage_(\d))?(?:_offload)?", strategy)
        return f"zero{match.group(1) or 2}" if match else "ddp"
    class_path = str(strategy.get("class_path", "")) if hasattr(strategy, "get") else ""
    if "deepspeed" not in class_path.lower():
        return "ddp"
    stage = (strategy.get("init_args") or {}).get("stage", 2)
    return f"zero{stage}"


def _seq_len(data: Any) -> int:
    """``data.init_args.seq_len``, or the sequence length in the manifest of a ShardDataModule's shards."""
    if "seq_len" in data:
        return int(data.seq_len)
    if data.get("shards"):
        from trainer.data.shards import load_manifest

        try:
            return load_manifest(data.shards)[0].seq_len
        except (OSError, ValueError) as err:
            raise DataError(
                f"draftsmith plan: the recipe's data has no init_args.seq_len and its shards' manifest cannot be "
                f"read ({err}); pass --seq_len"
            ) from err
    raise RecipeError("draftsmith plan: the recipe's data has no init_args.seq_len; pass --seq_len")


def parse_bytes(text: str) -> int:
    """'80GB', '80G', '80GiB', '141 GB' -> bytes (GB and G read as GiB, as GPU memory is quoted)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise UsageError(f"draftsmith plan: cannot read memory size {text!r} (e.g. 80GB)")
    scale = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def markdown_table(estimates: list[Estimate], budget: int) -> str:
    """A markdown table of the estimates (GiB, or MiB for small runs), with a 'fits' column against ``budget``."""
    unit, scale = ("GiB", GIB) if max(e.total for e in estimates) >= GIB else ("MiB", 1024**2)
    header = f"| strategy | target {unit} | drafter | grads | optimizer | activations | buffers | total {unit} | fits |"
    rows = [header, "|" + "---|" * 9]
    for e in estimates:
        cells = [e.target_weights, e.drafter_weights, e.gradients, e.optimizer, e.activations, e.buffers, e.total]
        fits = "yes" if e.total <= budget else "no"
        rows.append(f"| {e.stage} | " + " | ".join(f"{c / scale:.1f}" for c in cells) + f" | {fits} |")
    return "\n".join(rows)


def build_parser() -> ToolParser:
    """The parser of ``draftsmith plan``."""
    p = ToolParser(prog="draftsmith plan", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--config", action="append", required=True, help="recipe YAML (repeat to compose)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the data-parallel world (all nodes)")
    p.add_argument("--gpu_memory", default="80GB", help="memory of one GPU, e.g. 80GB")
    p.add_argument("--reserve", default="3GB", help="allowance for buffers, workspaces and fragmentation")
    p.add_argument(
        "--target",
        metavar="MODEL",
        help="the target instead of the recipe's: a built-in shape (" + ", ".join(sorted(PRESETS)) + "), an HF model "
        "folder, a config.json file or a hub id",
    )
    p.add_argument("--batch_size", type=int, help="override data.init_args.batch_size (per GPU)")
    p.add_argument("--seq_len", type=int, help="override data.init_args.seq_len")
    p.add_argument("--precision", help="override trainer.precision")
    p.add_argument(
        "--sequence_parallel",
        type=int,
        help="ranks sharing each row under DeepSpeed-Ulysses (default: the recipe's model.sequence_parallel, else 1)",
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help="also estimate one CPU process (what a CPU fit runs): the DDP row for 1 process plus the runtime's memory",
    )
    p.add_argument(
        "fit_args", nargs="*", help="after --: more `draftsmith fit` arguments, e.g. --model.loss_chunk_size 128"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``draftsmith plan``; returns the exit status (2 for a recipe or size it cannot read)."""
    args = build_parser().parse_args(argv)
    try:
        budget = parse_bytes(args.gpu_memory) - parse_bytes(args.reserve)  # bad sizes fail before any file is read
        plan = plan_from_recipe(
            args.config,
            args.target if args.target in PRESETS else None,
            None if args.target in PRESETS else args.target,
            args.batch_size,
            args.seq_len,
            args.precision,
            args.fit_args,
            args.sequence_parallel,
        )
        estimates = plan.estimates(args.gpus)
    except UserError as err:
        if debugging():
            raise
        print(error_report(err), file=sys.stderr)
        return 2
    except (OSError, ValueError) as err:  # a config or shards manifest that Hugging Face or json cannot read
        print(f"error: {err}", file=sys.stderr)
        return 2
    c = plan.counts
    out = [
        f"{c.method}: trained {c.trainable / 1e6:.1f}M parameters, frozen {c.frozen / 1e9:.3f}B elements; "
        f"batch {plan.batch} x seq {plan.seq} per GPU, {plan.precision}, {args.gpus} GPUs of {args.gpu_memory} "
        f"({args.reserve} reserved)"
        + (
            f"; sequence parallel {plan.sequence_parallel}: {plan.seq // plan.sequence_parallel} positions per GPU"
            if plan.sequence_parallel > 1
            else ""
        ),
        "",
        markdown_table(estimates, budget),
    ]
    fitting = [e.stage for e in estimates if e.total <= budget]
    out.append("")
    out.append(f"fits: {', '.join(fitting)}" if fitting else "fits: none (reduce the batch, or add GPUs)")
    if args.cpu:
        row = next(e for e in plan.estimates(1, cpu=True) if e.stage == plan.stage)
        process = row.total + CPU_RUNTIME_BYTES
        out.append(
            f"one CPU process ({plan.precision}, {plan.stage}): {process / GIB:.2f} GiB peak resident memory "
            f"({CPU_RUNTIME_BYTES / GIB:.2f} GiB of it the runtime)"
        )
    print("\n".join(out))
    return 0
