"""A Lightning callback that measures tau with real speculative decoding every N training steps.

The LightningModule being trained exposes the drafter-side protocol :class:`SpeculativeEvalModule`:

- ``target_model``: the frozen HF target (``AutoModelForCausalLM``), on the module's device;
- ``make_proposer() -> Proposer``: a proposer drafting with the module's current weights (for a distilled draft model,
  ``DraftModelProposer(self.student)``; for Medusa or EAGLE, their own proposers).

Every ``every_n_steps`` optimizer steps the callback decodes the held-out prompts greedily with the target alone (once,
then cached) and with speculation, checks that the outputs are identical (a difference raises), and logs
``spec_eval/tau``, ``spec_eval/acceptance_rate`` and ``spec_eval/loop_share`` through ``pl_module.log`` (TensorBoard
with the default logger).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from transformers import PreTrainedModel

from trainer.decoding import metrics
from trainer.decoding.evaluate import check_identity, loop_statistics, run_prompts
from trainer.decoding.proposers import NoProposer, Proposer


@runtime_checkable
class SpeculativeEvalModule(Protocol):
    """What the callback needs from the LightningModule."""

    target_model: PreTrainedModel

    def make_proposer(self) -> Proposer: ...


def read_token_prompts(path: str | Path) -> list[list[int]]:
    """Prompts from a jsonl file with an ``input_ids`` list of token ids per line."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            ids = record.get("input_ids") if isinstance(record, dict) else None
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise ValueError(f"{path}:{number}: needs a non-empty 'input_ids' list of token ids")
            prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


class SpeculativeEvalCallback(pl.Callback):
    """Log tau of the drafter being trained, measured by lossless speculative decoding on held-out prompts."""

    def __init__(
        self,
        prompts: str | list[list[int]] = "",
        k: int = 4,
        max_new_tokens: int = 64,
        every_n_steps: int = 500,
        max_prompts: int = 16,
        eos_token_id: int | None = None,
    ) -> None:
        """
        Args:
            prompts: a jsonl file with an ``input_ids`` token list per line, or the token lists themselves.
            k: drafts per round.
            max_new_tokens: output budget per prompt.
            every_n_steps: evaluate when the global step is a multiple of this (and > 0).
            max_prompts: use at most this many prompts (0: all).
            eos_token_id: token that ends a generation, or None for the full budget.
        """
        super().__init__()
        if k < 1 or max_new_tokens < 1 or every_n_steps < 1:
            raise ValueError(
                f"k, max_new_tokens and every_n_steps must be >= 1, got {k}, {max_new_tokens}, {every_n_steps}"
            )
        loaded = read_token_prompts(prompts) if isinstance(prompts, str | Path) else [list(p) for p in prompts]
        if not loaded:
            raise ValueError("SpeculativeEvalCallback needs at least one prompt")
        self.prompts = loaded[:max_prompts] if max_prompts > 0 else loaded
        self.k = k
        self.max_new_tokens = max_new_tokens
        self.every_n_steps = every_n_steps
        self.eos_token_id = eos_token_id
        self._reference = None
        self._last_step = -1
        self.last: dict[str, float] = {}

    def evaluate(self, pl_module: pl.LightningModule) -> dict[str, float]:
        """Run the evaluation now; returns the logged values."""
        if not isinstance(pl_module, SpeculativeEvalModule):
            raise TypeError(
                f"{type(pl_module).__name__} must expose target_model and make_proposer() for SpeculativeEvalCallback"
            )
        target = pl_module.target_model
        was_training = pl_module.training
        pl_module.eval()
        try:
            with torch.no_grad():
                if self._reference is None:
                    self._reference = run_prompts(
                        target, NoProposer(), self.prompts, 1, self.max_new_tokens, 0.0, self.eos_token_id
                    )
                results = run_prompts(
                    target, pl_module.make_proposer(), self.prompts, self.k, self.max_new_tokens, 0.0, self.eos_token_id
                )
        finally:
            pl_module.train(was_training)
        check_identity(self._reference, results, self.k)
        rounds = [r for res in results for r in res.rounds]
        loops, _ = loop_statistics(self._reference)
        self.last = {
            "spec_eval/tau": metrics.tau(rounds),
            "spec_eval/acceptance_rate": metrics.acceptance_rate(rounds),
            "spec_eval/loop_share": loops["share"],
        }
        return self.last

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        """Evaluate and log every ``every_n_steps`` global steps (every rank decodes the same prompts)."""
        step = trainer.global_step
        if step == 0 or step % self.every_n_steps or self._last_step == step:
            return
        self._last_step = step
        values = self.evaluate(pl_module)
        for name, value in values.items():
            pl_module.log(name, float(value), on_step=True, on_epoch=False, rank_zero_only=True)
