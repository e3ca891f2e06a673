"""The optimizer and learning-rate schedule of every objective: ``model.init_args.optim`` (:class:`Optim`).

:func:`build_optimizer` makes AdamW (fused on CPU; DeepSpeed's CPU Adam under optimizer offload) or Muon for the 2-D
hidden matrices beside AdamW for the rest (:mod:`trainer.training.muon`), over the parameter groups an objective trains
(``DraftObjective.lr_groups``: each module with its learning-rate multiplier); :func:`build_schedule` the linear warm-up
and decay over the run's optimizer steps (:func:`lr_factor`). ``DraftObjective.configure_optimizers`` calls both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy
from torch import nn

from trainer.distributed.strategies import deepspeed_offload_enabled
from trainer.interface.errors import RecipeError


@dataclass(frozen=True)
class Optim:
    """AdamW (or Muon for the hidden matrices) with linear warm-up and a decay to ``min_lr_ratio * lr``.

    Args:
        name: ``adamw``, or ``muon``: Muon for the 2-D hidden matrices and AdamW for vectors, embeddings and output
            heads (trainer/training/muon.py; speculators 0.9's default), one learning rate for both (Muon's update
            scaled to AdamW's RMS). Not under DeepSpeed, whose flat partitions Muon cannot orthogonalise.
        lr: peak learning rate.
        weight_decay: decoupled weight decay, applied to matrices only (not to norms or biases).
        betas: Adam's (beta1, beta2).
        eps: Adam's epsilon.
        warmup_steps: optimizer steps of linear warm-up from 0.
        decay: shape of the schedule after warm-up, over ``trainer.max_steps``.
        min_lr_ratio: the final learning rate as a fraction of ``lr``.
        muon_momentum: Muon's Nesterov momentum (``name: muon``).
    """

    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 0
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1
    muon_momentum: float = 0.95


LrGroups = Sequence[tuple[nn.Module, float]]
"""The trained modules, each with the multiplier of the peak learning rate it trains at."""


def lr_factor(step: int, optim: Optim, total_steps: int) -> float:
    """The multiplier of the peak learning rate at an optimizer step."""
    if optim.warmup_steps > 0 and step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.decay == "constant" or total_steps <= optim.warmup_steps:
        return 1.0
    progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if optim.decay == "cosine" else 1.0 - progress
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * shape


def build_optimizer(
    optim: Optim, lr_groups: LrGroups, strategy: Strategy | None = None, precision: str = "32-true"
) -> torch.optim.Optimizer:
    """The optimizer ``optim`` names over ``lr_groups``, for a run under ``strategy`` (None: outside a Trainer) at
    ``precision`` (Lightning's string)."""
    if optim.name == "muon":
        return muon_optimizer(optim, lr_groups, strategy)
    return adamw_optimizer(optim, lr_groups, strategy, precision)


def muon_optimizer(optim: Optim, lr_groups: LrGroups, strategy: Strategy | None = None) -> torch.optim.Optimizer:
    """Muon for the 2-D hidden matrices and AdamW for the rest (:class:`~trainer.training.muon.MuonWithAdamW`);
    refused under DeepSpeed and for a module without both kinds of parameters."""
    from trainer.training.muon import MuonWithAdamW, split_for_muon

    if isinstance(strategy, DeepSpeedStrategy):
        raise RecipeError(
            "model.init_args.optim.name: muon cannot run under DeepSpeed (it flattens the parameters into 1-D "
            "partitions; Muon orthogonalises matrices): use DDP or FSDP2, or optim.name: adamw"
        )
    muon_groups, adamw_groups = [], []
    for module, multiplier in lr_groups:
        muon, matrices, vectors = split_for_muon(module)
        lr = optim.lr * multiplier
        muon_groups.append({"params": muon, "weight_decay": optim.weight_decay, "lr": lr})
        adamw_groups.append({"params": matrices, "weight_decay": optim.weight_decay, "lr": lr})
        adamw_groups.append({"params": vectors, "weight_decay": 0.0, "lr": lr})
    muon_groups = [g for g in muon_groups if g["params"]]
    adamw_groups = [g for g in adamw_groups if g["params"]]
    if not muon_groups or not adamw_groups:
        raise RecipeError(
            f"model.init_args.optim.name: muon: the trained module has {'no' if not muon_groups else 'only'} "
            "2-D hidden matrices (Muon trains those, AdamW the rest): use optim.name: adamw"
        )
    return MuonWithAdamW(muon_groups, adamw_groups, betas=optim.betas, eps=optim.eps, momentum=optim.muon_momentum)


def adamw_optimizer(
    optim: Optim, lr_groups: LrGroups, strategy: Strategy | None = None, precision: str = "32-true"
) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only: DeepSpeed's CPU Adam under optimizer offload, else torch's, fused
    except in mixed precision."""
    groups = []
    for module, multiplier in lr_groups:
        decay = [p for p in module.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in module.parameters() if p.requires_grad and p.ndim < 2]
        lr = optim.lr * multiplier
        groups += [
            {"params": decay, "weight_decay": optim.weight_decay, "lr": lr},
            {"params": no_decay, "weight_decay": 0.0, "lr": lr},
        ]
    groups = [g for g in groups if g["params"]]
    if strategy is not None and deepspeed_offload_enabled(strategy):
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # offload refuses a torch optimizer

        return DeepSpeedCPUAdam(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps)
    # fused: one kernel over all the parameters (on CPU 5x faster than the default loop over tensors), except in mixed
    # precision, where Lightning clips only an unfused optimizer's gradients (and unscales float16's)
    mixed = "mixed" in str(precision)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, fused=not mixed)


def build_schedule(
    optimizer: torch.optim.Optimizer, optim: Optim, max_steps: int | None, estimate_steps: Callable[[], float]
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up and decay (``optim``) over the run's optimizer steps: ``trainer.max_steps`` when set, else
    ``estimate_steps()`` (Lightning's ``estimated_stepping_batches``, which loads the training data to count it;
    infinite when only ``trainer.max_time`` bounds the run, which only a constant schedule can take)."""
    total = max_steps if max_steps and max_steps > 0 else 0
    if total <= 0:
        estimated_steps = estimate_steps()
        if math.isinf(estimated_steps) and optim.decay != "constant":
            raise RecipeError(
                f"model.init_args.optim.decay={optim.decay!r} decays the learning rate over the run's "
                "length, but the run has no trainer.max_steps or max_epochs (trainer.max_time alone): set "
                "trainer.max_steps, or optim.decay: constant"
            )
        total = 0 if math.isinf(estimated_steps) else int(estimated_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, optim, total))
