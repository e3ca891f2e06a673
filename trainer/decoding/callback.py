"""A Lightning callback that measures tau with real speculative decoding every N training steps.

Every objective that trains a drafter implements the protocol :class:`SpeculativeEvalModule` through the base class
(trainer/training/objective.py): ``speculative_eval_target()`` (the frozen HF target, on the module's device),
``trainable_module()`` (the drafter as it is being trained) and ``drafter_record()`` (what it is). The callback asks the
record's drafter kind for a proposer (trainer/training/registry.py), the same factory ``draftsmith eval`` uses, with the
same :class:`~trainer.decoding.options.ProposerOptions` (``options``: ``tree``, ``tree_nodes``, ``exit_layer``...), so
what is logged during training is what ``eval`` measures afterwards with the same flags. In a recipe::

    - class_path: trainer.decoding.callback.SpeculativeEvalCallback
      init_args: {prompts: held_out.jsonl, k: 3, options: {tree: true, tree_nodes: 16}}

Every ``every_n_steps`` optimizer steps, and at the last step, the callback decodes the held-out prompts greedily
with the target alone (once, then cached) and with speculation, checks that the outputs are identical (a difference
raises, unless the target's own logits tie there to its dtype's rounding: trainer/decoding/identity.py), and logs
``spec_eval/tau``, ``spec_eval/acceptance_rate``, ``spec_eval/acceptance_{d}`` for every draft position d,
``spec_eval/loop_share`` and ``spec_eval/near_ties`` (prompts whose outputs parted on such a tie); with
``temperature > 0`` also ``spec_eval/tau_sampling`` and its acceptance. Values go to the trainer's loggers at that
step (TensorBoard with the recipes' logger). Every rank decodes the same prompts (under sharded strategies the
drafter's forward is collective); rank zero logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from torch import nn
from transformers import PreTrainedModel

from trainer.decoding import metrics
from trainer.decoding.context import cut_buckets, target_loss_by_context
from trainer.decoding.evaluate import load_prompts, loop_statistics, run_prompts
from trainer.decoding.identity import check_identity
from trainer.decoding.options import ProposerOptions
from trainer.decoding.proposers import NoProposer, Proposer
from trainer.interface.errors import UsageError
from trainer.training.registry import DrafterRecord, get_kind


@runtime_checkable
class SpeculativeEvalModule(Protocol):
    """What the callback needs from the LightningModule."""

    def speculative_eval_target(self) -> PreTrainedModel: ...

    def trainable_module(self) -> nn.Module: ...

    def drafter_record(self) -> DrafterRecord: ...


class SpeculativeEvalCallback(pl.Callback):
    """Log tau of the drafter being trained, measured by lossless speculative decoding on held-out prompts."""

    def __init__(
        self,
        prompts: str | list[list[int]] = "",
        prompt_tokens: int = 64,
        k: int = 4,
        max_new_tokens: int = 64,
        every_n_steps: int = 200,
        max_prompts: int = 8,
        temperature: float = 0.0,
        options: ProposerOptions = ProposerOptions(),
        seed: int = 0,
        eos_token_id: int | None = None,
        context_lengths: list[int] | None = None,
        documents: str | list[list[int]] | None = None,
    ) -> None:
        """
        Args:
            prompts: a jsonl file (one ``prompt``, chat ``messages``, ``text`` or ``input_ids`` per line; the
                corpus' held-out file works as it is), or the token lists themselves.
            prompt_tokens: each prompt is cut to its first this many tokens (0 keeps it whole).
            k: drafts per round.
            max_new_tokens: output budget per prompt.
            every_n_steps: evaluate when the global step is a multiple of this, and at the last step.
            max_prompts: use at most this many prompts (0: all).
            temperature: 0 measures greedy decoding only; above 0 also speculative sampling at this temperature.
            options: how to draft, as ``draftsmith eval``'s flags say it (``tree``, ``tree_nodes``, ``tree_top_k``,
                ``rank_temperature``, ``tree_choices``, ``exit_layer``: the layer self-speculative drafters exit at,
                ``accept_threshold``: dynamic draft length).
            seed: seed of the sampling mode.
            eos_token_id: token that ends a generation, or None for the full budget.
            context_lengths: also measure by context length (``draftsmith eval --context_lengths``): for each L, the
                first L tokens of every ``documents`` document at least L + ``max_new_tokens`` tokens long (the first
                ``max_prompts`` of them), logged as ``spec_eval/tau_ctx{L}`` and the like; None: off.
            documents: the long documents those prompts are cut from: a jsonl file in any of ``prompts``' line
                formats (such as the corpus' held-out file), each read whole, or token lists; None: ``prompts``.
        """
        super().__init__()
        if k < 1 or max_new_tokens < 1 or every_n_steps < 1 or prompt_tokens < 0 or temperature < 0:
            raise ValueError(
                "SpeculativeEvalCallback: k, max_new_tokens and every_n_steps must be >= 1, prompt_tokens and "
                f"temperature >= 0; got {k}, {max_new_tokens}, {every_n_steps}, {prompt_tokens}, {temperature}"
            )
        if isinstance(prompts, str) and not prompts:
            raise ValueError("SpeculativeEvalCallback needs prompts: a jsonl file or token lists")
        if context_lengths is not None and (not context_lengths or any(n < 1 for n in context_lengths)):
            raise UsageError(
                f"SpeculativeEvalCallback: context_lengths {context_lengths}: give a non-empty list of lengths >= 1 "
                "(or null: off)"
            )
        self.context_lengths = sorted(set(context_lengths)) if context_lengths else None
        self.documents = prompts if documents is None else documents
        self.buckets: dict[int, list[list[int]]] | None = None
        self._context_reference: dict[int, list] = {}
        self._context_losses: dict[int, dict] | None = None
        self.source = prompts
        self.prompt_tokens, self.max_prompts = prompt_tokens, max_prompts
        self.k, self.max_new_tokens, self.every_n_steps = k, max_new_tokens, every_n_steps
        self.temperature, self.seed, self.eos_token_id = temperature, seed, eos_token_id
        self.options = options
        self.prompts: list[list[int]] | None = None
        self._reference = None
        self._last_step = -1
        self.last: dict[str, float] = {}

    @staticmethod
    def _read(source: str | Path | list[list[int]], record: DrafterRecord, cut: int | None) -> list[list[int]]:
        """Token ids of a jsonl file (read with the drafter's tokenizer) or of token lists, each cut to ``cut``."""
        if isinstance(source, str | Path):
            from transformers import AutoTokenizer

            if not record.tokenizer:
                raise ValueError("SpeculativeEvalCallback: the drafter record names no tokenizer to read the prompts")
            tokenizer = AutoTokenizer.from_pretrained(record.tokenizer)
            return load_prompts(source, tokenizer, cut=cut)
        return [list(p)[:cut] for p in source]

    def _load_prompts(self, record: DrafterRecord) -> list[list[int]]:
        prompts = self._read(self.source, record, self.prompt_tokens or None)
        if not prompts:
            raise ValueError("SpeculativeEvalCallback needs at least one prompt")
        return prompts[: self.max_prompts] if self.max_prompts > 0 else prompts

    def _cut_buckets(self, record: DrafterRecord, target: PreTrainedModel) -> dict[int, list[list[int]]]:
        """The prompts of every context length, cut as ``draftsmith eval --context_lengths`` cuts them."""
        context = getattr(target.config, "max_position_embeddings", None)
        source = str(self.documents) if isinstance(self.documents, str | Path) else "the documents given"
        return cut_buckets(
            self._read(self.documents, record, None), self.context_lengths, self.max_new_tokens,
            context - self.max_new_tokens if context else None, self.max_prompts, source,
            "SpeculativeEvalCallback: context_lengths", "max_new_tokens",
        )  # fmt: skip

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check the module before training starts: a module that cannot be measured fails now, not at step N."""
        if not isinstance(pl_module, SpeculativeEvalModule):
            raise TypeError(f"{type(pl_module).__name__} does not implement the SpeculativeEvalCallback protocol")
        target = pl_module.speculative_eval_target()
        self.prompts = self._load_prompts(pl_module.drafter_record())
        if self.context_lengths:
            self.buckets = self._cut_buckets(pl_module.drafter_record(), target)

    def evaluate(self, pl_module: pl.LightningModule) -> dict[str, float]:
        """Run the evaluation now; returns the values logged."""
        target = pl_module.speculative_eval_target()
        record = pl_module.drafter_record()
        if self.prompts is None:
            self.prompts = self._load_prompts(record)
        if self.context_lengths and self.buckets is None:
            self.buckets = self._cut_buckets(record, target)
        kind = get_kind(record.kind, type(pl_module).__name__)
        was_training = pl_module.training
        pl_module.eval()
        values: dict[str, float] = {}
        try:
            with torch.no_grad():
                proposer = kind.proposer(pl_module.trainable_module(), record, target, self.options)
                proposer.check_k(self.k)
                # a target that trains (Medusa-2, LayerSkip, MTP heads fine-tunes: the model drafts for itself)
                # changes its own greedy output between evaluations: its reference is decoded anew each time
                trains = any(p.requires_grad for p in target.parameters())
                if self._reference is None or trains:
                    self._reference = run_prompts(
                        target, NoProposer(), self.prompts, 1, self.max_new_tokens, 0.0, self.eos_token_id
                    )
                threshold = self.options.accept_threshold  # dynamic draft length (0: off)
                greedy = run_prompts(
                    target, proposer, self.prompts, self.k, self.max_new_tokens, 0.0, self.eos_token_id,
                    accept_threshold=threshold,
                )  # fmt: skip
                ties = check_identity(self._reference, greedy, self.k, target, self.prompts)
                values["spec_eval/near_ties"] = float(len(ties))
                values.update(self._values(greedy, ""))
                values["spec_eval/loop_share"] = loop_statistics(self._reference)[0]["share"]
                if self.temperature > 0:
                    sampled = run_prompts(
                        target, proposer, self.prompts, self.k, self.max_new_tokens, self.temperature,
                        self.eos_token_id, self.seed, threshold,
                    )  # fmt: skip
                    values.update(self._values(sampled, "_sampling"))
                if self.buckets and (self._context_losses is None or trains):  # changes only if the target trains
                    self._context_losses = target_loss_by_context(target, self.buckets)
                for length, prompts in (self.buckets or {}).items():
                    values.update(self._context_values(target, proposer, length, prompts, trains))
        finally:
            pl_module.train(was_training)
        self.last = values
        return values

    def _context_values(
        self, target: PreTrainedModel, proposer: Proposer, length: int, prompts: list[list[int]], trains: bool
    ) -> dict[str, float]:
        """The values of one context length's prompts, decoded on their own (suffix ``_ctx{length}``)."""
        suffix = f"_ctx{length}"
        if length not in self._context_reference or trains:
            self._context_reference[length] = run_prompts(
                target, NoProposer(), prompts, 1, self.max_new_tokens, 0.0, self.eos_token_id
            )
        reference = self._context_reference[length]
        threshold = self.options.accept_threshold
        greedy = run_prompts(
            target, proposer, prompts, self.k, self.max_new_tokens, 0.0, self.eos_token_id, accept_threshold=threshold
        )
        ties = check_identity(reference, greedy, self.k, target, prompts)
        values = self._values(greedy, suffix)
        values[f"spec_eval/near_ties{suffix}"] = float(len(ties))
        values[f"spec_eval/loop_share{suffix}"] = loop_statistics(reference)[0]["share"]
        values[f"spec_eval/target_loss{suffix}"] = (self._context_losses or {})[length]["target_loss"]
        if self.temperature > 0:
            sampled = run_prompts(
                target, proposer, prompts, self.k, self.max_new_tokens, self.temperature, self.eos_token_id,
                self.seed, threshold,
            )  # fmt: skip
            values.update(self._values(sampled, f"_sampling{suffix}"))
        return values

    def _values(self, results, suffix: str) -> dict[str, float]:
        rounds = [r for res in results for r in res.rounds]
        out = {
            f"spec_eval/tau{suffix}": metrics.tau(rounds),
            f"spec_eval/acceptance_rate{suffix}": metrics.acceptance_rate(rounds),
        }
        for d, rate in enumerate(metrics.acceptance_per_position(rounds, self.k), 1):
            out[f"spec_eval/acceptance{suffix}_{d}"] = rate
        if self.options.accept_threshold > 0 and rounds:  # dynamic draft length: how many drafts a round verified
            out[f"spec_eval/drafts_per_round{suffix}"] = sum(r.nodes for r in rounds) / len(rounds)
        return out

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        """Evaluate and log every ``every_n_steps`` global steps and at the last one."""
        step = trainer.global_step
        last = trainer.max_steps > 0 and step >= trainer.max_steps
        if step == 0 or self._last_step == step or (step % self.every_n_steps and not last):
            return
        self._last_step = step
        values = {name: float(value) for name, value in self.evaluate(pl_module).items()}
        if trainer.is_global_zero:  # written at this step whatever the trainer's log_every_n_steps
            for logger in trainer.loggers:
                logger.log_metrics(values, step=step)
