"""What ``draftsmith compare`` reads of a fit: the steps a budget means for a recipe, and the scalars it logged."""

from __future__ import annotations

import math
from pathlib import Path

from trainer.compare.config import Budget


def steps_for_budget(budget: Budget, recipe: str, fit_args: list[str]) -> int | None:
    """Optimizer steps of ``budget`` for ``recipe`` with ``fit_args``; None for a wall-clock budget.

    A token budget is divided by the tokens of one optimizer step: the recipe's ``data.init_args.batch_size`` x
    ``seq_len`` x ``trainer.accumulate_grad_batches`` x devices x nodes (read with fit's own parser).
    """
    if budget.steps is not None:
        return budget.steps
    if budget.tokens is None:
        return None
    from trainer.training.recipe import RecipeError, parse_recipe

    try:
        fit = parse_recipe([recipe], fit_args)
    except RecipeError as err:
        raise RecipeError(f"{recipe}: {err}") from err
    data = fit.data.init_args
    batch, seq_len = getattr(data, "batch_size", None), getattr(data, "seq_len", None)
    if not isinstance(batch, int) or not isinstance(seq_len, int):
        raise RecipeError(
            f"{recipe}: a token budget needs data.init_args.batch_size and seq_len in the recipe (got {batch} and "
            f"{seq_len}); give this method a budget in steps"
        )
    devices = fit.trainer.devices if isinstance(fit.trainer.devices, int) and fit.trainer.devices > 0 else 1
    per_step = batch * seq_len * (fit.trainer.accumulate_grad_batches or 1) * devices * (fit.trainer.num_nodes or 1)
    return max(1, math.ceil(budget.tokens / per_step))


def loss_of(recipe: str, fit_args: list[str]) -> str:
    """The loss a method trains with, as the report's ``loss`` column shows it: the objective's ``model.loss`` (the
    cross entropy on tokens, ``ce``, for an objective without one) and its ``model.labels`` where it has them, read
    with fit's own parser (the recipe's value, else the objective's default)."""
    from trainer.training.recipe import parse_recipe

    args = parse_recipe([recipe], fit_args).model.init_args
    loss = getattr(args, "loss", None) or "ce"
    labels = getattr(args, "labels", None)
    return f"{loss}, {labels} labels" if isinstance(labels, str) else loss


def read_scalars(log_dir: Path, tags: tuple[str, ...]) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every TensorBoard event file under ``log_dir`` (a resumed fit writes a new version
    folder: all are read, a later file's value winning at the same step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    files = sorted(log_dir.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    for path in files:
        events = EventAccumulator(str(path), size_guidance={"scalars": 0})
        events.Reload()
        available = set(events.Tags()["scalars"])
        for tag in tags:
            if tag in available:
                out.setdefault(tag, {}).update({e.step: float(e.value) for e in events.Scalars(tag)})
    return out


def tokens_at(tokens: dict[int, float], step: int) -> float | None:
    """Training tokens at ``step``, interpolated between the logged steps around it (None without any)."""
    if not tokens:
        return None
    steps = sorted(tokens)
    if step in tokens:
        return tokens[step]
    before = [s for s in steps if s < step]
    after = [s for s in steps if s > step]
    if not before:
        return tokens[after[0]] * step / after[0]
    if not after:
        return tokens[before[-1]] * step / before[-1]
    lo, hi = before[-1], after[0]
    return tokens[lo] + (tokens[hi] - tokens[lo]) * (step - lo) / (hi - lo)
