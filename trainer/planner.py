"""``draftsmith plan``: bytes per GPU of a distillation recipe under DDP and DeepSpeed ZeRO 1, 2 and 3.

    draftsmith plan --config recipes/quickstart/kd.yaml --gpus 8 --gpu_memory 80GB [--target llama-3-8b] [-- FIT ARGS]

The recipe is parsed as ``draftsmith fit`` parses it (:func:`trainer.recipe.parse_recipe`: the same ``--config``
composition, the same errors for unknown keys, the signatures' defaults filled in; fit arguments go after ``--``), and
nothing is instantiated: the target's config comes from ``AutoConfig.from_pretrained(model.init_args.target)`` (or
``--target_config DIR|config.json``, or a built-in ``--target`` preset for the Llama 3 shapes, no hub needed), the
drafter is the target's config with ``model.init_args.drafter_config`` applied (as the KD objective builds it) or
``model.init_args.drafter``'s config, batch and sequence come from ``data.init_args`` (a ShardDataModule's sequence
length from its shards' manifest), chunk size from ``model.init_args.loss_chunk_size`` and precision from
``trainer.precision``.

What is counted, per GPU, for N GPUs (the ZeRO paper's accounting, Adam/AdamW):

* target weights: P_t x (4 bytes for 32-true, else 2); frozen, whole on every rank, except under ZeRO-3, which
  partitions every parameter of the module (the frozen target included) and gathers one layer at a time;
* drafter weights: P_d x w (w = 4 for 32-true, 2 for bf16/16 precisions); divided by N under ZeRO-3;
* gradients: P_d x w; divided by N under ZeRO-2 and 3;
* optimizer states: P_d x K, K = 8 (two fp32 moments) plus 4 for the fp32 master weights under mixed precision;
  divided by N under ZeRO-1, 2 and 3;
* activations: the drafter's tensors saved for backward, B x S x (10 H + 4 I + 2 H_kv) x a bytes per layer (a = 4 for
  32-true, else 2; fused attention, no S x S scores) plus its embeddings; the target's largest transient layer under
  no_grad; and the logits: chunked float32 logits of both models (``chunk_size`` positions) for DDP/ZeRO-1/2, plus
  both [B, S, V] logit tensors in the model dtype under ZeRO-3 (the KD objective takes the logits from the forward
  when the output weight is sharded).

Not counted: the framework's own buffers (DeepSpeed bucket sizes, NCCL workspaces, allocator fragmentation, CUDA
context), usually 1 to 4 GB per GPU; ``--reserve`` subtracts an allowance (default 3 GB) from the GPU memory before
deciding what fits. tests/unit/test_planner.py checks the parameter, gradient and optimizer counts exactly and the
activation estimate against tensors measured on CPU for the tiny recipes.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import DataError, ModelFolderError, RecipeError, UsageError, UserError, debugging, error_report
from trainer.flags import ToolParser

GIB = 1024**3
STAGES = ("ddp", "zero1", "zero2", "zero3")

# Hub-free shapes (Llama 3 family, from their published config.json files).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "llama-3-70b": dict(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
}


@dataclass(frozen=True)
class Shape:
    """The sizes of a decoder-only (Llama-like) causal LM that memory depends on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "config") -> Shape:
        """From an HF config (a dict, e.g. ``AutoConfig(...).to_dict()``); ``source`` names it in errors."""
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            if config.get(k) is None
        ]
        if missing:
            raise ModelFolderError(f"draftsmith plan: {source} has no {', '.join(missing)} (a decoder-only LM config?)")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        kv = config.get("num_key_value_heads")
        head_dim = config.get("head_dim")
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(kv) if kv is not None else heads,
            head_dim=int(head_dim) if head_dim is not None else hidden // heads,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
        )

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    def layer_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.q_width + 2 * h * self.kv_width + self.q_width * h
        if self.attention_bias:
            attn += self.q_width + 2 * self.kv_width + h
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        return attn + mlp + 2 * h  # two RMSNorm weights

    def parameters(self) -> int:
        """Exact parameter count of the HF Llama implementation with this shape."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + self.num_hidden_layers * self.layer_parameters() + self.hidden_size + head


def precision_bytes(precision: str) -> tuple[int, int, int]:
    """(weight and gradient bytes, optimizer bytes per parameter, activation bytes) for a Lightning precision."""
    p = str(precision)
    if p in ("32", "32-true", "64", "64-true"):
        return 4, 8, 4
    if p in ("bf16-mixed", "16-mixed", "16", "bf16"):
        return 2, 12, 2  # half-precision model copy, fp32 master weights + two fp32 moments
    if p in ("bf16-true", "16-true"):
        return 2, 4, 2  # moments in the parameters' dtype, no master copy
    raise RecipeError(f"draftsmith plan: unknown trainer.precision {precision!r}")


@dataclass(frozen=True)
class Estimate:
    """Bytes per GPU of one strategy."""

    stage: str
    target_weights: int
    drafter_weights: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.target_weights + self.drafter_weights + self.gradients + self.optimizer + self.activations


def drafter_activation_bytes(shape: Shape, batch: int, seq: int, act_bytes: int) -> int:
    """Tensors the drafter saves for backward: per layer, norms' inputs and outputs, q/k/v/attention output, MLP."""
    h, i = shape.hidden_size, shape.intermediate_size
    per_layer = batch * seq * (10 * h + 4 * i + 2 * shape.kv_width)
    return (shape.num_hidden_layers * per_layer + 2 * batch * seq * h) * act_bytes


def target_activation_bytes(shape: Shape, batch: int, seq: int, act_bytes: int) -> int:
    """The target's forward under no_grad: the residual stream plus one layer's largest transients."""
    h, i = shape.hidden_size, shape.intermediate_size
    return batch * seq * (3 * h + 3 * i) * act_bytes


def logits_bytes(target: Shape, batch: int, seq: int, chunk: int, act_bytes: int, sharded: bool) -> int:
    """Chunked float32 logits of both models (a few live copies per chunk), plus whole logits when sharded."""
    chunked = 6 * min(chunk, batch * seq) * target.vocab_size * 4
    whole = 2 * batch * seq * target.vocab_size * act_bytes if sharded else 0
    return chunked + whole


def estimate(
    target: Shape,
    drafter: Shape,
    batch: int,
    seq: int,
    gpus: int,
    precision: str = "bf16-mixed",
    chunk_size: int = 256,
) -> list[Estimate]:
    """Bytes per GPU for DDP and ZeRO stages 1-3.

    Args:
        target: the frozen target's shape.
        drafter: the trained drafter's shape.
        batch: sequences per GPU per step.
        seq: tokens per sequence.
        gpus: data-parallel world size (all GPUs of all nodes).
        precision: Lightning's trainer.precision.
        chunk_size: positions per chunk of the KD loss.
    """
    if gpus < 1 or batch < 1 or seq < 1:
        raise UsageError(f"draftsmith plan: gpus, batch and seq must be positive, got {gpus}, {batch}, {seq}")
    w, k, a = precision_bytes(precision)
    target_w = 4 if str(precision) in ("32", "32-true") else 2
    p_t, p_d = target.parameters(), drafter.parameters()
    acts = drafter_activation_bytes(drafter, batch, seq, a) + target_activation_bytes(target, batch, seq, a)
    out = []
    for stage in STAGES:
        n = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[stage]

        def shard(x: int, at_stage: int, n: int = n) -> int:
            return -(-x // gpus) if n >= at_stage else x  # ceil division from that stage on

        gathered_layer = target.layer_parameters() * target_w if n >= 3 else 0
        out.append(
            Estimate(
                stage=stage,
                target_weights=shard(p_t * target_w, 3) + gathered_layer,
                drafter_weights=shard(p_d * w, 3),
                gradients=shard(p_d * w, 2),
                optimizer=shard(p_d * k, 1),
                activations=acts + logits_bytes(target, batch, seq, chunk_size, a, sharded=n >= 3),
            )
        )
    return out


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
            f"draftsmith plan: cannot read the config of {source!r} ({err}); pass --target_config or a --target "
            f"preset ({', '.join(PRESETS)})"
        ) from err


@dataclass(frozen=True)
class Plan:
    """The inputs of :func:`estimate` read from a recipe."""

    target: Shape
    drafter: Shape
    batch: int
    seq: int
    precision: str
    chunk_size: int


def plan_from_recipe(
    configs: list[str],
    target: str | None = None,
    target_config: str | None = None,
    batch: int | None = None,
    seq: int | None = None,
    precision: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> Plan:
    """Read the target, drafter, batch, sequence and precision from a recipe (nothing is instantiated).

    Args:
        configs: recipe YAMLs in --config order.
        target: a preset name (see PRESETS) instead of the recipe's target.
        target_config: an HF config.json or model folder instead of the recipe's target.
        batch: overrides data.init_args.batch_size.
        seq: overrides data.init_args.seq_len.
        precision: overrides trainer.precision.
        overrides: more ``draftsmith fit`` arguments, applied after the configs as fit applies them.

    Raises:
        trainer.recipe.RecipeError: a recipe or override ``draftsmith fit`` would refuse (fit's message).
        ValueError: a recipe the planner cannot size, or a target config it cannot read.
    """
    from trainer.recipe import parse_recipe

    recipe = parse_recipe(configs, overrides)
    if recipe.get("model") is None:
        raise RecipeError("draftsmith plan: the recipe has no model")
    model = recipe.model.init_args
    data = recipe.get("data.init_args")
    model_name = recipe.model.class_path.rsplit(".", 1)[-1]
    if target is not None:
        if target not in PRESETS:
            raise UsageError(f"draftsmith plan: unknown --target {target!r}; presets: {', '.join(PRESETS)}")
        target_dict = dict(PRESETS[target])
        source = f"preset {target}"
    elif target_config is not None:
        target_dict, source = _load_config(target_config), target_config
    elif model.get("target"):
        target_dict, source = _load_config(str(model.target)), str(model.target)
    else:
        raise RecipeError(
            f"draftsmith plan: the recipe's model ({model_name}) has no init_args.target; pass --target or "
            "--target_config"
        )
    if model.get("drafter"):
        drafter_dict = _load_config(str(model.drafter))
    elif "drafter_config" in model:
        drafter_config = dict(model.drafter_config or {})
        drafter_dict = dict(target_dict)
        for key, value in drafter_config.items():
            if key not in drafter_dict and key not in ("head_dim", "tie_word_embeddings", "num_key_value_heads"):
                raise RecipeError(f"draftsmith plan: model.init_args.drafter_config: {key!r} is not a key of {source}")
            drafter_dict[key] = value
        if "hidden_size" in drafter_config and "head_dim" not in drafter_config:
            drafter_dict.pop("head_dim", None)  # follows the new width, as in the HF config
    else:
        raise RecipeError(
            f"draftsmith plan: the recipe's model ({model_name}) has neither init_args.drafter nor "
            "init_args.drafter_config (the planner covers distilled draft models)"
        )
    if "loss_chunk_size" not in model:
        raise RecipeError(f"draftsmith plan: the recipe's model ({model_name}) has no init_args.loss_chunk_size")
    if data is None:
        raise RecipeError("draftsmith plan: the recipe has no data")
    if batch is None:
        if "batch_size" not in data:
            raise RecipeError("draftsmith plan: the recipe's data has no init_args.batch_size; pass --batch_size")
        batch = data.batch_size
    if seq is None:
        seq = _seq_len(data)
    if precision is None:
        # trainer.precision's default, None, is 32-true in Lightning's accelerator connector
        precision = recipe.trainer.precision if recipe.trainer.precision is not None else "32-true"
    return Plan(
        target=Shape.from_config(target_dict, source),
        drafter=Shape.from_config(drafter_dict, "the drafter config"),
        batch=int(batch),
        seq=int(seq),
        precision=str(precision),
        chunk_size=int(model.loss_chunk_size),
    )


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
    header = f"| strategy | target {unit} | drafter | grads | optimizer | activations | total {unit} | fits |"
    rows = [header, "|" + "---|" * 8]
    for e in estimates:
        cells = [e.target_weights, e.drafter_weights, e.gradients, e.optimizer, e.activations, e.total]
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
    group = p.add_mutually_exclusive_group()
    group.add_argument("--target", choices=sorted(PRESETS), help="a built-in target shape, not the recipe's target")
    group.add_argument("--target_config", help="an HF config.json or model folder instead of the recipe's target")
    p.add_argument("--batch_size", type=int, help="override data.init_args.batch_size (per GPU)")
    p.add_argument("--seq_len", type=int, help="override data.init_args.seq_len")
    p.add_argument("--precision", help="override trainer.precision")
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
            args.config, args.target, args.target_config, args.batch_size, args.seq_len, args.precision, args.fit_args
        )
        estimates = estimate(
            plan.target, plan.drafter, plan.batch, plan.seq, args.gpus, plan.precision, plan.chunk_size
        )
    except UserError as err:
        if debugging():
            raise
        print(error_report(err), file=sys.stderr)
        return 2
    except (OSError, ValueError) as err:  # a config or shards manifest that Hugging Face or json cannot read
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = [
        f"target {plan.target.parameters() / 1e9:.3f}B parameters, drafter {plan.drafter.parameters() / 1e6:.1f}M; "
        f"batch {plan.batch} x seq {plan.seq} per GPU, {plan.precision}, {args.gpus} GPUs of {args.gpu_memory} "
        f"({args.reserve} reserved)",
        "",
        markdown_table(estimates, budget),
    ]
    fitting = [e.stage for e in estimates if e.total <= budget]
    out.append("")
    out.append(f"fits: {', '.join(fitting)}" if fitting else "fits: none (reduce the batch, or add GPUs)")
    print("\n".join(out))
    return 0
