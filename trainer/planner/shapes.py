"""Shapes and the ZeRO accounting of ``draftsmith plan``: preset sizes of Llama-like causal LMs (each a
:class:`trainer.training.activation_memory.Shape`, whose parameter counts are the HF implementation's), the bytes per
parameter of a precision, and the bytes per GPU of one trained and one frozen model under DDP and ZeRO 1, 2 and 3
(:func:`estimate`, :func:`estimate_counts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.interface.errors import RecipeError, UsageError
from trainer.training.activation_memory import HALF_TRUE, MIXED, Shape

GIB = 1024**3

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
        rope_theta=500000.0,
    ),
    "llama-3-70b": dict(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
}


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
    buffers: int = 0  # AdamW's step temporaries, and DeepSpeed's gradient partition and buckets (zero_buffer_bytes)
    step_buffers: int = 0  # the part of buffers alive only in the optimizer step, after backward freed the activations

    @property
    def total(self) -> int:
        """The peak: weights, gradients, optimizer state and the buffers that stay, plus the larger of the
        activations (forward and backward) and the step-only buffers (the optimizer step), which never coexist."""
        parts = (self.target_weights, self.drafter_weights, self.gradients, self.optimizer)
        return sum(parts) + self.buffers - self.step_buffers + max(self.activations, self.step_buffers)


ZERO_OPTIMIZER_BYTES = 12
"""Optimizer bytes per trained parameter under every ZeRO stage and precision: DeepSpeed's optimizer keeps an fp32
master copy of its partition (a clone even when the model is fp32) beside AdamW's two fp32 moments."""
REDUCE_BUCKET_ELEMENTS = 200_000_000
"""Lightning's DeepSpeedStrategy ``reduce_bucket_size``: the gradient bucket, allocated twice (``overlap_comm`` and
``contiguous_gradients`` are on by default) in ZeRO-1 and ZeRO-2 at every backward."""


def zero_buffer_bytes(trained: int, stage: int, gpus: int, grad_bytes: int) -> int:
    """DeepSpeed's buffers beyond the ZeRO paper's accounting, per process, for ``trained`` parameters: the fp32
    gradient of the optimizer's partition (``single_partition_of_fp32_groups[i].grad``, 4 bytes a parameter over
    ``gpus``), AdamW's step temporary over that partition (:func:`adamw_step_bytes`), and for stages 1 and 2 the two
    gradient buckets of :data:`REDUCE_BUCKET_ELEMENTS` (fp32 for ZeRO-1, the gradients' dtype for ZeRO-2; a CPU
    process touches no more of a bucket than the gradients fill)."""
    if stage >= 3:
        return zero_step_bytes(trained, gpus)
    bucket_bytes = 4 if stage == 1 else grad_bytes
    return zero_step_bytes(trained, gpus) + 2 * min(REDUCE_BUCKET_ELEMENTS, trained) * bucket_bytes


def zero_step_bytes(trained: int, gpus: int) -> int:
    """DeepSpeed's buffers that live only in the optimizer step: the fp32 gradient of the optimizer's partition
    (built from the reduced gradients in ``step()`` and dropped after it) and AdamW's temporary over that partition.
    Backward has freed the activations by then, so an :class:`Estimate` counts the larger of the two, not both: the
    real-width rehearsal measured the sum 1.7 to 2.1 GiB over the peak of DFlash's ZeRO-2 fits, whose activations
    (a chunked loss over the vocabulary) are about as large as these buffers (docs/benchmarks/rehearsal.md)."""
    fp32_partition = -(-trained * 4 // gpus)
    return fp32_partition + adamw_step_bytes(fp32_partition)


def adamw_step_bytes(parameter_bytes: int) -> int:
    """The temporary of one AdamW step over parameters of ``parameter_bytes``: torch's foreach implementation takes
    the square root of every second moment into new tensors (``_foreach_sqrt``) before the update, one copy of the
    parameters' size alive at the step's peak."""
    return parameter_bytes


def zero_row(
    stage: int,
    trained: int,
    weight_bytes: int,
    gpus: int,
    frozen: int,
    frozen_sharded: int,
    gathered: int,
    activations: int,
) -> Estimate:
    """The bytes per process of ZeRO stage ``stage`` (1-3), the one row builder of :func:`estimate` and
    :func:`estimate_counts`: ``trained`` parameters in weights and gradients of ``weight_bytes`` (partitioned from
    stage 3 and 2), DeepSpeed's 12 optimizer bytes each (partitioned from stage 1) and its buffers
    (:func:`zero_buffer_bytes`); frozen bytes ``frozen`` kept whole plus ``frozen_sharded`` partitioned from stage 3,
    where the largest layer, ``gathered`` bytes, is gathered whole for its forward."""

    def shard(x: int, at_stage: int) -> int:
        return -(-x // gpus) if stage >= at_stage else x  # ceil division from that stage on

    return Estimate(
        stage=f"zero{stage}",
        target_weights=frozen + shard(frozen_sharded, 3) + (gathered if stage >= 3 else 0),
        drafter_weights=shard(trained * weight_bytes, 3),
        gradients=shard(trained * weight_bytes, 2),
        optimizer=shard(trained * ZERO_OPTIMIZER_BYTES, 1),
        activations=activations,
        buffers=zero_buffer_bytes(trained, stage, gpus, weight_bytes),
        step_buffers=zero_step_bytes(trained, gpus),
    )


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
    ddp_activations = acts + logits_bytes(target, batch, seq, chunk_size, a, sharded=False)
    out = [Estimate("ddp", p_t * target_w, p_d * w, p_d * w, p_d * k, ddp_activations, adamw_step_bytes(p_d * 4))]
    gathered = target.layer_parameters() * target_w
    for n in (1, 2, 3):
        activations = acts + logits_bytes(target, batch, seq, chunk_size, a, sharded=n >= 3)
        out.append(zero_row(n, p_d, w, gpus, 0, p_t * target_w, gathered, activations))
    return out


@dataclass(frozen=True)
class Counts:
    """What a built objective holds (:mod:`trainer.planner.build`), in elements and in bytes as built.

    Attributes:
        method: the objective's class name.
        trainable: parameters the optimizer trains (``trainable_module()``, ``requires_grad``).
        trainable_bytes: their bytes in the dtype the objective builds them in (``drafter_dtype``...).
        frozen: elements of every other tensor the objective holds (targets, frozen copies, frozen parts of the
            drafter such as a copied embedding, buffers).
        frozen_bytes: their bytes as built (``target_dtype``...).
        frozen_in_tree: the part of ``frozen`` inside the objective's module tree: cast by a ``*-true`` precision
            and by DeepSpeed, partitioned by ZeRO-3 (a target kept out of the tree is neither).
        frozen_in_tree_bytes: their bytes as built.
        largest_layer_bytes: the largest frozen decoder layer, which ZeRO-3 gathers whole.
    """

    method: str
    trainable: int
    trainable_bytes: int
    frozen: int
    frozen_bytes: int
    frozen_in_tree: int
    frozen_in_tree_bytes: int
    largest_layer_bytes: int = 0


def estimate_counts(counts: Counts, activations: int, gpus: int, precision: str) -> list[Estimate]:
    """Bytes per GPU (per process) of a built objective for DDP and ZeRO 1-3.

    DDP (and a single process: ``gpus=1``, what a CPU fit runs) follows Lightning's precision plugins: the trained
    weights stay in the dtype the objective built them in (cast to half by ``*-true``), their gradients and AdamW's two
    moments have that dtype, and ``*-mixed`` autocast keeps a half copy of every trained weight for backward. ZeRO
    stages follow DeepSpeed: half weights and gradients under mixed precision, fp32 master weights and moments (12
    bytes) under every precision, and DeepSpeed's buffers (:func:`zero_buffer_bytes`).

    Args:
        counts: what the objective holds.
        activations: the step's activation bytes (the objective's ``activation_bytes``).
        gpus: data-parallel processes.
        precision: Lightning's trainer.precision.
    """
    if gpus < 1:
        raise UsageError(f"draftsmith plan: gpus must be positive, got {gpus}")
    p = str(precision)
    precision_bytes(p)  # an unknown precision is refused
    per = counts.trainable_bytes / max(counts.trainable, 1)  # bytes per trained parameter as built
    if p in HALF_TRUE:
        per = 2
    outside = counts.frozen_bytes - counts.frozen_in_tree_bytes  # kept out of the module tree: as built
    frozen_ddp = outside + (2 * counts.frozen_in_tree if p in HALF_TRUE else counts.frozen_in_tree_bytes)
    trained = int(counts.trainable * per)
    autocast_copies = 2 * counts.trainable if p in MIXED and per > 2 else 0
    out = [
        Estimate(
            "ddp", frozen_ddp, trained, trained, 2 * trained, activations + autocast_copies, adamw_step_bytes(trained)
        )
    ]
    w, _, _ = precision_bytes(p)
    in_tree = 2 * counts.frozen_in_tree if w == 2 else counts.frozen_in_tree_bytes  # DeepSpeed casts to half
    for n in (1, 2, 3):
        out.append(zero_row(n, counts.trainable, w, gpus, outside, in_tree, counts.largest_layer_bytes, activations))
    return out
