"""EAGLE-3: train a one-layer drafter on fused target features with training-time test (TTT).

Online mode: the frozen target runs inside the training step and gives the hidden states of the drafter's aux layers and
its predictions: with soft labels only over the draft vocabulary (its final hidden state projected onto those rows of
its lm_head, no [B, S, V] logits; vocab_map.online_target_signals), with argmax labels over every token. Element ``t``
of a row pairs the fused features of token ``t`` with the embedding of token ``t + 1``; at unrolled step ``i`` it
predicts token ``t + 2 + i``, labelled by the target's prediction at position ``t + 1 + i`` (its distribution over the
draft vocabulary, renormalised, or its argmax), under the loss mask of that token, with weight ``step_decay ** i``. Step
``i > 0`` feeds the drafter's own output features of step ``i - 1`` at positions shifted by ``i``, with the row's own
token ``t + 1 + i`` (``ttt_inputs: data``, the default, as the reference implementations do) or the drafter's own argmax
of step ``i - 1`` (``predicted``); see module.py for the attention.

Why data tokens by default: the label of step ``i`` is the target's prediction after the row's tokens. Where the
drafter's step ``i - 1`` guess is wrong, a ``predicted`` input contradicts that label, and the drafter learns to
predict the row's continuation whatever token it is fed; at inference a chain only continues past a right guess, where
the two inputs are the same token.

Offline mode (``target_signals: shards``): the batches of a ShardDataModule carry the aux layers' hidden states and
the target's top-k next tokens at temperature 1, written by ``draftsmith precompute`` (recipes/quickstart/
precompute_eagle3.yaml). The target model is never built: only its config and the two tensors the drafter needs, the
input embedding (the drafter's input) and the lm_head (which initialises the draft lm_head rows), are read from its
safetensors (trainer.models.target.TargetEmbeddings). Soft labels are the top-k probabilities restricted to the draft
vocabulary and renormalised over it (positions where none of the k ids is in it are not trained); argmax labels use the
top-1 id, the accuracies the best-ranked id in the draft vocabulary (soft labels) or the top-1 id (argmax), as online.
With k equal to the vocabulary and float32 shards it is the online objective.

Accuracies (``acc_i``) count the drafts equal to the target's most likely token: among the draft vocabulary's tokens
with soft labels (what the loss sees, and what speculators reports), among all tokens with argmax labels.

The loss (``model.loss``, trainer/losses/distribution.py; labels.py): ``kl`` (the default) is the cross entropy above;
``tv``, ``nla`` and ``lk_hybrid`` (the LK losses) train toward the target's own probabilities over the draft vocabulary,
not renormalised, so the mass of target tokens outside it counts as rejected (with argmax labels: toward the label's
one-hot, ``nla`` then being the cross entropy and ``tv`` ``1 - q_label``). ``alpha_i`` logs step i's expected acceptance
under speculative sampling, ``sum_v min(p_v, q_v)`` of the drafter's distribution q over the draft vocabulary and the
target's p there, not renormalised (online: the target's full distribution at temperature 1, its log-partition over the
whole vocabulary taken a chunk of positions at a time; shards: the stored top-k, a lower bound), for every loss and
either labels, averaged over the step's trained positions.

Memory: a step's activations would grow linearly in K. With ``recompute`` (the default) the steps 0..K-2 keep only
their inputs and outputs (features, keys and values: what later steps read) and are rerun in backward, their logits
and loss included; the last step, the first one backward needs, is stored as before. It trades step time for memory
(bench/bench_eagle3_ttt.py measures both; docs/benchmarks/memory.md); the loss and gradients are unchanged (tested).
``attention: flex`` (or ``auto``) runs the TTT mask through flex attention on CUDA
(trainer/models/block_attention.py), which stores no attention probabilities; it is checked against the dense
path on CPU (forward) but has not been run on a GPU in this repository, so the default stays ``dense``.

The reduced vocabulary (vocab_map.py) is counted once from the datamodule's training rows in
``setup`` (the text rows, or the shards' tokens and loss masks); it is a buffer of the drafter, so a resumed run gets
the checkpoint's map back when Lightning restores the state dict after ``setup``, and ``init_from`` (fine-tuning from
a checkpoint) takes the checkpoint's map and never counts. The target (or its two tensors) is kept outside the module
tree, so checkpoints hold the drafter only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.distributed.sequence_parallel import (
    SequenceParallel,
    check_sequence_parallel,
    register_ulysses_sdpa,
    ulysses_attention,
    whole_row_target,
)
from trainer.interface.errors import RecipeError
from trainer.losses.distribution import DEFAULT_ETA, acceptance, loss_rows, sparse_loss_rows
from trainer.methods.eagle3 import kind as eagle3_kind
from trainer.methods.eagle3 import vocab_map
from trainer.methods.eagle3.labels import check_argmax_weight, check_loss, mix_argmax
from trainer.methods.eagle3.module import Eagle3Config, Eagle3Drafter, ttt_attention
from trainer.models.block_attention import Impl
from trainer.models.documents import check_window, document_positions
from trainer.models.target import resolve_dtype
from trainer.training.activation_memory import F32, PlannedStep, Shape, dense_scores, frozen_forward, layer_saved
from trainer.training.objective import (
    DataRequirements,
    DraftObjective,
    TargetSignals,
    causal_lm_flops_per_token,
    count_params,
)
from trainer.training.optimizers import Optim
from trainer.training.registry import DrafterRecord

log = logging.getLogger(__name__)


def _ttt_attention_of(impl: Impl, q, keys, values, window, documents) -> torch.Tensor:
    """:func:`ttt_attention` with ``impl`` first, as :func:`ulysses_attention` wraps it."""
    return ttt_attention(q, keys, values, impl, window, documents)


class Eagle3(DraftObjective):
    """Trains an EAGLE-3 drafter against an online frozen target, or from precomputed target shards.

    A method that extends EAGLE-3 (P-EAGLE: trainer/methods/peagle/objective.py) subclasses it and inherits what both
    do alike: :meth:`drafter_from_init` (``init_from`` and the options it must agree with), :meth:`new_config` (the
    draft vocabulary and target-layer checks), ``setup`` with the vocabulary map (:meth:`install_vocab_map`), naming
    its own :attr:`drafter_kind` and :attr:`method_name`.
    """

    drafter_kind: str = eagle3_kind.KIND
    """The kind of the drafters it trains (``init_from`` must hold one)."""
    method_name: str = "EAGLE-3"
    """The method's name in messages."""
    honours_document_ids = True  # target and TTT attention see document_ids; cross-document labels are not trained
    plans_sequence_parallel = True  # activation_bytes plans DeepSpeed-Ulysses (draftsmith plan --sequence_parallel)

    def __init__(
        self,
        target: str,
        draft_vocab_size: int = 32000,
        target_layers: list[int] | None = None,
        ttt_steps: int = 7,
        step_decay: float = 0.8,
        labels: Literal["soft", "argmax"] = "soft",
        argmax_weight: float = 0.0,
        loss: Literal["kl", "tv", "nla", "lk_hybrid"] = "kl",
        lk_eta: float = DEFAULT_ETA,
        ttt_inputs: Literal["data", "predicted"] = "data",
        init_from: str | None = None,
        target_dtype: str = "float32",
        drafter_dtype: str = "float32",
        trust_remote_code: bool = False,
        seed: int = 0,
        target_signals: TargetSignals = "online",
        recompute: bool = True,
        attention: Impl = "dense",
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
        fc_norm: bool = False,
        norm_output: bool = False,
        window: int | None = None,
        sequence_parallel: int = 1,
        optim: Optim = Optim(),
    ) -> None:
        """
        Args:
            target: the target, an HF causal LM directory or hub id.
            draft_vocab_size: size of the reduced draft vocabulary (the most frequent trained tokens).
            target_layers: the target layers fused by the drafter (its aux layers), in HF hidden_states indices (the
                input of layer i; 0 is the embeddings); None uses 2, L // 2, L - 3.
            ttt_steps: K, the unrolled drafting steps of training-time test.
            step_decay: weight of step i is step_decay ** i.
            labels: "soft" matches the target's distribution over the draft vocabulary (renormalised; cross entropy
                with soft labels, i.e. forward KL up to a constant), "argmax" its argmax (positions whose argmax is
                outside the draft vocabulary are skipped).
            argmax_weight: with soft labels, the weight w of a cross entropy on the target's most likely token of the
                draft vocabulary: each position's loss is ``(1 - w) * soft + w * CE(argmax)``, in [0, 1]. The argmax is
                what greedy verification accepts; the soft part keeps the distribution sampling accepts. Default 0
                (soft labels alone). Only with ``loss: kl``.
            loss: each position's loss (trainer/losses/distribution.py): "kl" (the cross entropy above), "tv" (1 -
                alpha, alpha = sum_v min(p_v, q_v) the expected acceptance, p the target's probabilities over the draft
                vocabulary, not renormalised), "nla" (-log alpha) or "lk_hybrid" (lambda * KL + (1 - lambda) * TV,
                lambda = exp(-lk_eta * alpha)); with argmax labels p is the label's one-hot.
            lk_eta: the hybrid's temperature eta (3, the LK paper's and speculators' default).
            ttt_inputs: tokens fed at steps i > 0: "data" (the row's own next tokens, which the labels are
                conditioned on, as the reference implementations do) or "predicted" (the drafter's own argmax of step
                i - 1, which contradicts the label wherever that guess was wrong; see the module docstring).
            init_from: a training checkpoint (.ckpt or DeepSpeed directory) of an EAGLE-3 run to start from: its
                weights, shape and vocabulary map are used, and the map is not recounted on this run's data.
            target_dtype: the target's weights dtype (float32, bfloat16, float16).
            drafter_dtype: the drafter's weights dtype.
            trust_remote_code: allow custom modelling code in the target directory (off by default).
            seed: seed for the drafter's initialisation.
            target_signals: "online" runs the target in every step; "shards" reads the hidden states of its
                target_layers and its top-k next tokens (temperature 1) from the batches of a ShardDataModule whose
                hidden_layers are the target_layers (written by ``draftsmith precompute``), loading only the target's
                config, embedding and lm_head, never the model.
            recompute: recompute TTT steps 0..K-2 in backward instead of storing their activations (each keeps its
                inputs and outputs only; the last step is stored, as it is the first one backward needs): less
                memory held for backward, for a longer step (bench/bench_eagle3_ttt.py measures both).
            attention: the TTT attention: "dense" (mask-aware, the default), "flex" (flex attention, CUDA) or "auto"
                (flex on CUDA, dense elsewhere).
            norm_before_residual: the drafter layer's residual is its normed input features (``hidden_norm(h)``)
                instead of the raw ones (speculators' ``norm_before_residual``).
            norm_before_fc: one RMSNorm over the concatenated target hidden states before ``fc`` (speculators'
                ``norm_before_fc``, gpt-oss style); exclusive with fc_norm.
            fc_norm: one RMSNorm per target hidden state before the concatenation and ``fc`` (EAGLE-3.1, speculators'
                ``fc_norm``); exclusive with norm_before_fc.
            norm_output: feed the post-norm drafter output to the next TTT step and drafting step, and to ``lm_head``
                (EAGLE-3.1 against attention drift, speculators' ``norm_output``).
            window: sliding-window draft attention, in tokens: a query at position t sees keys at t - window + 1 .. t
                (trainer/models/documents.py), in training-time test and in drafting alike; null (the default) attends
                to every earlier key. Exported as the layer config's ``sliding_window`` and ``layer_types`` in the
                speculators format; the native format refuses it. With ``init_from`` it replaces the window the drafter
                was trained with (a mask, not a weight).
            sequence_parallel: ranks sharing each row under DeepSpeed-Ulysses
                (trainer/distributed/sequence_parallel.py), for rows longer than one GPU holds: each holds S / P
                consecutive positions of every row, the target and the drafter attending over the whole row with 1 / P
                of the heads; the ranks of a group read the same rows, so the data-parallel replicas are world / P. 1
                (the default): none. Needs an online target, DDP or DeepSpeed, P dividing the world size, both models'
                key/value heads and the rows' lengths, and rows of at least P * ttt_steps tokens.
            optim: optimizer and learning-rate schedule.
        """
        super().__init__(optim)
        self.save_hyperparameters(ignore=["optim"])
        if ttt_steps < 1:
            raise RecipeError(f"model.ttt_steps must be >= 1, got {ttt_steps}")
        if not 0.0 < step_decay <= 1.0:
            raise RecipeError(f"model.step_decay must be in (0, 1], got {step_decay}")
        self.argmax_weight = check_argmax_weight(argmax_weight, labels)
        self.loss_spec = check_loss(loss, lk_eta, argmax_weight)
        self.ttt_steps, self.step_decay, self.labels, self.ttt_inputs = ttt_steps, step_decay, labels, ttt_inputs
        self.recompute, self.attention = recompute, attention
        check_window(window, "model.window")
        if isinstance(sequence_parallel, bool) or sequence_parallel < 1:
            raise RecipeError(f"model.sequence_parallel={sequence_parallel!r}: a positive number of ranks (1: none)")
        if sequence_parallel > 1 and target_signals != "online":
            raise RecipeError(
                f"model.sequence_parallel={sequence_parallel} needs target_signals: online (the target runs on each "
                "rank's slice of the row); shards hold whole rows"
            )
        self.sequence_parallel = sequence_parallel
        self._sp: SequenceParallel | None = None  # built in setup
        self._ttt_ulysses: Callable[..., torch.Tensor] | None = None
        frozen = self.load_target(target, target_signals, target_dtype, trust_remote_code)
        flags = self.norm_flags(
            norm_before_residual=norm_before_residual,
            norm_before_fc=norm_before_fc,
            fc_norm=fc_norm,
            norm_output=norm_output,
        )
        torch.manual_seed(seed)
        self.vocab_fixed = init_from is not None
        if init_from is not None:
            self.drafter = self.drafter_from_init(init_from, flags)
        else:
            self.drafter = Eagle3Drafter(self.new_config(frozen, target, draft_vocab_size, target_layers, flags))
        self.drafter.config.window = window
        self.drafter.to(resolve_dtype(drafter_dtype))

    # ---- what the methods extending EAGLE-3 share (P-EAGLE, trainer/methods/peagle/) ----------------------------
    def drafter_from_init(self, init_from: str, asked: dict[str, object]) -> Eagle3Drafter:
        """The drafter of ``model.init_from`` (of kind :attr:`drafter_kind`), its shape and its vocabulary map.

        Args:
            init_from: a training checkpoint or an export.
            asked: option name -> the value this run's recipe gives it, each an attribute of the drafter's config
                (the norm flags, P-EAGLE's ``num_layers``): one that differs from what the drafter was trained with
                is refused by name.
        """
        drafter = self.drafter_from_checkpoint(init_from, self.drafter_kind)
        for name, value in asked.items():
            trained = getattr(drafter.config, name)
            if trained != value:
                raise RecipeError(
                    f"model.{name} is {str(value).lower()} but model.init_from {init_from!r} was trained with "
                    f"{name}: {str(trained).lower()}",
                    hint=f"set model.{name}: {str(trained).lower()} to fine-tune this drafter",
                )
        log.info("%s drafter, its shape and its vocabulary map loaded from %s", self.method_name, init_from)
        return drafter

    @staticmethod
    def norm_flags(**flags: bool) -> dict[str, bool]:
        """The recipe's norm flags (module.NORM_FLAGS, those the method has), refused when ``norm_before_fc`` and
        ``fc_norm`` are both set."""
        if flags.get("norm_before_fc") and flags.get("fc_norm"):
            raise RecipeError("model.norm_before_fc and model.fc_norm are mutually exclusive: set one of them")
        return flags

    def new_config(
        self, frozen, target: str, draft_vocab_size: int, target_layers: list[int] | None, flags: dict[str, bool]
    ) -> Eagle3Config:
        """The shape of a new drafter for the loaded target ``frozen`` (``target`` names it in errors): the draft
        vocabulary no larger than the target's, the target layers (None: the default three) inside its hidden states
        0..L, the norm ``flags`` as given."""
        vocab_map.check_draft_vocab(draft_vocab_size, frozen.vocab_size, target)
        config = Eagle3Config.from_target(frozen.config, draft_vocab_size, target_layers, **flags)
        config.vocab_size = frozen.vocab_size
        for i in config.aux_layers:
            if not 0 <= i <= frozen.num_layers:
                raise RecipeError(
                    f"model.target_layers: {i} is outside the target's hidden_states 0..{frozen.num_layers}"
                )
        return config

    def trainable_module(self) -> nn.Module:
        return self.drafter

    # ---- the reduced vocabulary ----------------------------------------------------------------------------------
    def data_requirements(self) -> DataRequirements:
        """The target's tokenizer; shards of this target, tokenizer and vocabulary at temperature 1 (the labels are
        the target's own distribution), holding the drafter's target layers in its order (teacher_hidden[:, j] is
        fused as layer j)."""
        config = self.drafter.config
        return DataRequirements(
            self.target.vocab_size, target_layers=config.aux_layers, hidden_size=config.target_hidden_size
        )

    def setup(self, stage: str) -> None:
        """The data's checks, the sequence-parallel groups, then the draft vocabulary counted on the training rows
        (unless ``init_from`` gave it)."""
        super().setup(stage)
        datamodule = self.attached_datamodule()
        if self.sequence_parallel > 1 and self._sp is None:
            self._setup_sequence_parallel(datamodule)
        if self.vocab_fixed:
            return
        if self.target_signals == "shards":
            self.install_vocab_map(datamodule.training_rows())
            return
        dataset = getattr(datamodule, "train_dataset", None)
        if dataset is None or not hasattr(dataset, "ids"):
            raise RecipeError(
                f"{self.method_name} needs the training rows to count its draft vocabulary: the datamodule has no "
                "train_dataset with ids and trained arrays (or pass model.init_from)"
            )
        self.build_vocab_map(dataset.ids, dataset.trained)

    def _setup_sequence_parallel(self, datamodule) -> None:
        """Refuses what Ulysses cannot run here, naming the key, then builds the groups and the whole-row attentions
        of the target (:func:`register_ulysses_sdpa`) and of the training-time test."""
        from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

        size, key = self.sequence_parallel, "model.sequence_parallel"
        config, text = self.drafter.config, self.target.config
        text = text.get_text_config() if hasattr(text, "get_text_config") else text
        if getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True):
            raise RecipeError(f"{key}={size}: the target has sliding-window layers, which the whole-row attention "
                              "does not apply")  # fmt: skip
        for rows_key in ("seq_len", "long_seq_len"):  # the text datamodule's row lengths (None: no long rows)
            rows = getattr(datamodule, rows_key, None)
            if rows is None:
                continue
            for kv_heads in (config.num_key_value_heads, text.num_key_value_heads):  # the drafter's, the target's
                check_sequence_parallel(size, kv_heads, int(rows), key, f"data.{rows_key}")
            if rows // size < self.ttt_steps:
                raise RecipeError(f"{key}={size}: rows of {rows} tokens leave {rows // size} positions per rank, "
                                  f"fewer than ttt_steps={self.ttt_steps}")  # fmt: skip
        if not isinstance(self.trainer.strategy, (DDPStrategy, DeepSpeedStrategy)):
            raise RecipeError(
                f"{key}={size} runs under DDP or DeepSpeed (recipes/_base/ddp.yaml, deepspeed_zero*.yaml), not "
                f"{type(self.trainer.strategy).__name__}"
            )
        self._sp = SequenceParallel.build(size, key)
        register_ulysses_sdpa(self._sp.group)
        impl = self.attention
        self._ttt_ulysses = ulysses_attention(partial(_ttt_attention_of, impl), self._sp.group)
        if self.trainer.is_global_zero:
            log.info("%s: sequence parallel over %d ranks per row (DeepSpeed-Ulysses)", self.method_name, size)

    def build_vocab_map(self, ids, trained, chunk_rows: int = 4096) -> None:
        """:meth:`install_vocab_map` of [R, S + 1] ``ids`` and ``trained`` arrays, read ``chunk_rows`` at a time."""
        self.install_vocab_map(
            (ids[i : i + chunk_rows], trained[i : i + chunk_rows]) for i in range(0, len(ids), chunk_rows)
        )

    def install_vocab_map(self, rows: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
        """Count the trained labels of ``(ids, trained)`` chunks ([r, S + 1] each, trainer/data/packing.py's
        convention), install the map and copy the target's lm_head rows.

        Every rank computes the same map from the same rows (deterministic; no communication needed).
        """
        cfg = self.drafter.config
        share = vocab_map.install_vocab_map(self.drafter, self.target.lm_head_weight, rows)
        if self._trainer is None or self.trainer.is_global_zero:
            log.info("%s draft vocabulary: %d of %d tokens, %.3f of the trained labels", self.method_name,
                     cfg.draft_vocab_size, cfg.vocab_size, share)  # fmt: skip

    # ---- training ------------------------------------------------------------------------------------------------
    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids = batch["input_ids"]  # [B, S]
        # [B, S] packed rows with document masking, else absent (shard batches never carry it: precompute refuses
        # data.document_masking, and target_signals: shards takes a ShardDataModule only)
        documents = batch.get("document_ids")
        if self._sp is not None:
            return self._sequence_parallel_loss(ids, batch["loss_mask"], documents)
        if self.target_signals == "shards":
            signals = self._shard_signals(batch)
        else:
            signals = self._online_signals(ids, documents)
        return self._ttt_loss(ids, batch["loss_mask"], *signals, documents=documents)

    def _sequence_parallel_loss(
        self, ids: torch.Tensor, loss_mask: torch.Tensor, documents: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The training-time-test loss of this rank's slice of the batch's rows (every rank of the group holds the
        whole rows' ``ids``, ``loss_mask`` and ``documents`` [B, S]): the target runs on the slice's positions, the
        labels of the slice's last elements (at most ``ttt_steps`` positions ahead) come from the next rank, and the
        loss's value is the group's while its gradient is this rank's share of it times the group size (gradients are
        averaged over every rank)."""
        sp = self._sp
        B, S = ids.shape
        part = sp.part(S)
        steps = min(self.ttt_steps, S - 1)
        self.count_tokens(B * (part.stop - part.start))  # the group's ranks read the same rows
        positions = torch.arange(S, device=ids.device).expand(B, S)  # [B, S]
        if documents is not None:
            positions = document_positions(documents)
        with_mass = not self.loss_spec.is_kl or self.metrics_due()
        with whole_row_target(self.target.model, documents):
            hidden, argmax, probs, mass = vocab_map.online_target_signals(
                self.target, ids[:, part], self.drafter, self.labels == "soft", with_mass,
                position_ids=positions[:, part],
            )  # fmt: skip
        fused = self.drafter.fuse(hidden)  # [B, S / P, H]: every position of the slice is an element

        def ahead(x: torch.Tensor) -> torch.Tensor:  # [B, S / P, ...] -> [B, S / P + steps, ...]
            return torch.cat([x, sp.following(x, steps)], dim=1)

        signals = (ahead(argmax), ahead(probs), None, None if mass is None else ahead(mass))
        embedding = self.target.model.get_input_embeddings()
        return self._ttt_loss(ids, loss_mask, fused, embedding, *signals, documents=documents, part=part)

    def _draft_index(self) -> torch.Tensor:
        """[V] the draft index of every target id (meaningful where ``t2d``)."""
        return torch.cumsum(self.drafter.t2d.long(), 0) - 1

    def _online_signals(self, ids: torch.Tensor, documents: torch.Tensor | None = None):
        """Runs the target: (fused [B, S - 1, H], embedding, argmax [B, S], its distribution over the draft vocabulary
        renormalised [B, S, Vd], None, its mass there [B, S] or None when neither the loss nor this step's logged
        metrics read it; vocab_map.online_target_signals). ``documents`` [B, S]: each document of a packed row run
        alone (trainer/models/documents.py), or None."""
        with_mass = not self.loss_spec.is_kl or self.metrics_due()  # alpha_i is logged only every N steps
        hidden, argmax, probs, mass = vocab_map.online_target_signals(
            self.target, ids, self.drafter, self.labels == "soft", with_mass, documents
        )
        fused = self.drafter.fuse([h[:, :-1] for h in hidden])  # [B, S - 1, H]
        return fused, self.target.model.get_input_embeddings(), argmax, probs, None, mass

    def _shard_signals(self, batch: dict[str, torch.Tensor]):
        """The same from a shard batch: the stored top-k's share of the draft vocabulary stands for the distribution;
        the fifth item, [B, S] bool, is False where no top-k id is in the draft vocabulary (a soft label without
        mass)."""
        drafter = self.drafter
        hidden = batch["teacher_hidden"]  # [B, n, S, Ht], n aux layers in config order
        dtype = drafter.fc.weight.dtype
        fused = drafter.fuse([hidden[:, j, :-1].to(dtype) for j in range(hidden.shape[1])])  # [B, S - 1, H]
        topk_ids = batch["teacher_topk_ids"].long()  # [B, S, k], descending
        weight = self.target.embedding

        def embedding(tokens: torch.Tensor) -> torch.Tensor:
            return F.embedding(tokens, weight)  # [..., Ht]

        argmax = topk_ids[..., 0]  # [B, S]: the top-1 id (argmax labels)
        in_draft = drafter.t2d[topk_ids]  # [B, S, k]
        p = batch["teacher_topk_logprobs"].float().exp() * in_draft  # [B, S, k]
        B, S, _ = topk_ids.shape
        probs = p.new_zeros(B, S, drafter.config.draft_vocab_size)  # [B, S, Vd]
        probs.scatter_add_(-1, self._draft_index()[topk_ids].clamp(min=0), p)
        mass = probs.sum(-1, keepdim=True)  # [B, S, 1]
        valid = mass[..., 0] > 0  # [B, S]
        probs = probs / mass.clamp(min=torch.finfo(torch.float32).tiny)
        if self.labels != "soft":
            return fused, embedding, argmax, probs, None, mass[..., 0]
        # the target's most likely token of the draft vocabulary, as online soft labels give it
        argmax = torch.where(valid, drafter.to_target_ids(probs.argmax(-1)), argmax)  # [B, S]
        return fused, embedding, argmax, probs, valid, mass[..., 0]

    def _ttt_loss(
        self,
        ids: torch.Tensor,
        loss_mask: torch.Tensor,
        fused: torch.Tensor,
        embedding: Callable[[torch.Tensor], torch.Tensor],
        target_argmax: torch.Tensor,
        target_probs: torch.Tensor,
        label_ok: torch.Tensor | None,
        target_mass: torch.Tensor | None,
        documents: torch.Tensor | None = None,
        part: slice | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The training-time-test loss, whatever the source of the target's signals.

        Args:
            ids, loss_mask: [B, S] the batch's tokens and trained flags.
            fused: [B, N, H] fused target features of the elements: tokens 0..S-2 (N = S - 1), or under sequence
                parallelism this rank's slice ``part`` of the row's tokens (N = S / P).
            embedding: token ids -> the target's input embeddings.
            target_argmax: [B, M] the target's most likely next token at every label position, from the elements'
                first token on (M = S; under sequence parallelism the slice and the next ``ttt_steps`` positions),
                among the draft vocabulary's tokens with soft labels (argmax labels, accuracies).
            target_probs: [B, M, Vd] the target's distribution over the draft vocabulary, renormalised (the soft
                labels).
            label_ok: [B, M] bool, False where a soft label is missing (not trained), or None (all present).
            target_mass: [B, M] the target's probability of the draft vocabulary: ``target_probs * target_mass`` is
                its own, what the acceptance ``alpha_i`` and the losses other than ``kl`` are measured against; None
                (``kl`` on a step whose metrics are not logged): ``alpha_i`` is not computed.
            documents: [B, S] the document of every position of a packed row (trainer/models/documents.py), or None (one
                document): element t attends within token t's document, at rotary positions counted from its first
                token, and step i does not train (nor count in its metrics) an element whose label position
                t + 1 + i lies in another document.
            part: this rank's positions of the row under sequence parallelism (:class:`SequenceParallel`), or None.
        """
        drafter = self.drafter
        B, S = ids.shape
        sp = self._sp if part is not None else None
        first = 0 if part is None else part.start  # the row position of the first element
        count = fused.shape[1]  # N elements
        spec = self.loss_spec
        soft_labels = mix_argmax(target_probs, self.argmax_weight) if self.labels == "soft" else None  # [B, M, Vd]
        if self.labels == "argmax":
            t2d_index = self._draft_index()  # [V] draft index of every target id
            hard = torch.where(drafter.t2d[target_argmax], t2d_index[target_argmax], -100)  # [B, M]
        steps = min(self.ttt_steps, S - 1)  # step i trains elements whose label position t + 1 + i is in the row
        row_tokens = F.pad(ids, (0, steps + 1), value=0)  # [B, S + K + 1] token t + 1 + i is fed to element t at i
        row_mask = F.pad(loss_mask, (0, steps + 1), value=0)  # [B, S + K + 1]: nothing trained past the row
        positions = torch.arange(S, device=ids.device).expand(B, S)  # [B, S] rotary positions of step 0
        elements = attended = None  # [B, N] the document of element t (token t's); what the attention reads
        if documents is not None:
            positions = document_positions(documents)  # [B, S] counted within each document
            row_documents = F.pad(documents, (0, steps + 1), value=-1)
            elements = documents[:, first : first + count]
            attended = elements if part is None else documents  # Ulysses attends over the whole row's elements
        positions = positions[:, first : first + count]  # [B, N]
        attention = self._ttt_ulysses if part is not None else None

        def labelled(i: int) -> int:  # elements of step i whose label position is among the label arrays'
            return min(count, target_argmax.shape[1] - 1 - i)

        # what each step trains: [B, n_i] masks, known before the drafter runs
        trained_at, mask_at = [], []
        for i in range(steps):
            n = labelled(i)
            trained = row_mask[:, first + 1 + i : first + 1 + i + n].bool()  # [B, n]
            if elements is not None:  # the label position in the element's own document
                trained = trained & (row_documents[:, first + 1 + i : first + 1 + i + n] == elements[:, :n])
            mask = trained.float()  # [B, n]
            if label_ok is not None:
                mask = mask * label_ok[:, 1 + i : 1 + i + n]
            if self.labels == "argmax":
                mask = mask * (hard[:, 1 + i : 1 + i + n] >= 0)
            trained_at.append(trained)
            mask_at.append(mask)
        counts = torch.stack([m.sum() for m in mask_at] + [t.sum().float() for t in trained_at])  # [2K]
        if sp is not None:
            counts = sp.total(counts)  # the group's
        weight, seen = counts[:steps].clamp(min=1.0), counts[steps:].clamp(min=1.0)

        def step(i: int, hidden: torch.Tensor, tokens: torch.Tensor, *kv: torch.Tensor):
            """TTT step i: (out, k, v, loss_i, hits_i, alpha_i, guess [B, N]) from the step's inputs alone, so that
            it can be recomputed in backward; loss_i is this rank's share of the step's mean loss, hits_i and alpha_i
            its sums over trained elements."""
            out, logits, k, v = drafter.ttt_step(
                embedding, hidden, tokens, positions + i, kv[:i], kv[i:], self.attention, attended, attention
            )
            n = labelled(i)
            trained, mask = trained_at[i], mask_at[i]
            labels_at = slice(1 + i, 1 + i + n)
            log_q = torch.log_softmax(logits[:, :n].float(), dim=-1)  # [B, n, Vd]
            own = None  # [B, n, Vd] the target's own probabilities (not renormalised), where known
            if target_mass is not None:
                own = target_probs[:, labels_at] * target_mass[:, labels_at, None]
            if self.labels == "soft":
                if spec.is_kl:
                    per_pos = -(soft_labels[:, labels_at] * log_q).sum(-1)  # [B, n]
                else:
                    per_pos = loss_rows(logits[:, :n], own, spec, want_kl=False)[0]  # [B, n]
            else:
                labels = hard[:, labels_at]  # [B, n]
                if spec.is_kl:
                    per_pos = -log_q.gather(-1, labels.clamp(min=0)[..., None])[..., 0]  # [B, n]
                else:  # toward the label's one-hot
                    one = torch.ones_like(labels, dtype=log_q.dtype)[..., None]  # [B, n, 1]
                    per_pos = sparse_loss_rows(logits[:, :n], labels.clamp(min=0)[..., None], one, spec)[0]
            loss_i = (per_pos * mask).sum() / weight[i]
            with torch.no_grad():
                guess = drafter.to_target_ids(logits.max(-1).indices)  # [B, N], argmax (labels.py: faster)
                hits = ((guess[:, :n] == target_argmax[:, labels_at]) & trained).sum().float()
                alpha = None  # [] the summed expected acceptance, where the target's own probabilities are known
                if own is not None:
                    alpha = (acceptance(log_q.exp(), own) * trained).sum()
            return out, k, v, loss_i, hits, alpha, guess

        hidden, tokens = fused, row_tokens[:, first + 1 : first + 1 + count]  # [B, N] token t + 1
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        total = fused.new_zeros((), dtype=torch.float32)
        sums = []  # per step: loss share, hits, alpha (or nothing)
        for i in range(steps):
            inputs = (hidden, tokens, *keys, *values)
            if self.recompute and i < steps - 1 and torch.is_grad_enabled():
                # earlier steps keep only their inputs and outputs; the last step's activations are needed first in
                # backward, so recomputing it would save nothing at the peak
                hidden, k, v, loss_i, hits, alpha, guess = checkpoint(partial(step, i), *inputs, use_reentrant=False)
            else:
                hidden, k, v, loss_i, hits, alpha, guess = step(i, *inputs)
            keys.append(k)
            values.append(v)
            total = total + self.step_decay**i * loss_i
            sums.append((loss_i.detach(), hits, alpha))
            if self.ttt_inputs == "data":
                tokens = row_tokens[:, first + i + 2 : first + i + 2 + count]  # [B, N] token t + 2 + i
            else:
                tokens = guess
        with_alpha = [alpha is not None for _, _, alpha in sums]
        flat = torch.stack([x for loss_i, hits, alpha in sums for x in (loss_i, hits, alpha) if x is not None])
        if sp is not None:
            flat = sp.total(flat)  # the group's sums
            # the group's loss as the value; this rank's share times P as the gradient (averaged over every rank)
            share = total * sp.size
            total = sp.total(total) + share - share.detach()
        metrics: dict[str, torch.Tensor] = {}
        at = 0
        for i in range(steps):
            metrics[f"acc_{i}"] = flat[at + 1] / seen[i]
            metrics[f"loss_{i}"] = flat[at]
            if with_alpha[i]:
                metrics[f"alpha_{i}"] = flat[at + 2] / seen[i]
            at += 3 if with_alpha[i] else 2
        return total, metrics

    # ---- memory (draftsmith plan) --------------------------------------------------------------------------------
    def draft_layer_shape(self) -> Shape:
        """The draft decoder layer's shape, over the draft vocabulary."""
        c = self.drafter.config
        return Shape(c.draft_vocab_size, c.hidden_size, c.intermediate_size, 1, c.num_attention_heads,
                     c.num_key_value_heads, c.head_dim)  # fmt: skip

    def target_phase_bytes(self, step: PlannedStep, soft: bool) -> tuple[int, int]:
        """(the target phase's bytes, what it hands the drafter): every hidden state HF returns with
        output_hidden_states, and ``soft`` labels projected onto the draft vocabulary's lm_head rows only ([B, S, Vd]
        logits and their float32 softmax) with the whole vocabulary's log-partition a chunk of positions at a time
        (vocab_map.draft_mass), argmax labels onto every token ([B, S, V], then the draft rows' float32 logits and
        softmax); from shards the batch's teacher hidden states (bf16). Handed over: the fused features and the
        target's float32 distribution over the draft vocabulary (the soft labels; with either labels, for alpha)."""
        n, a, a_t = step.tokens, step.element, step.target_element
        config = self.drafter.config
        t = Shape.of(self.target_config)
        vd = config.draft_vocab_size
        if step.shards:
            target_phase = len(config.aux_layers) * n * t.hidden_size * 2
        else:
            vocab_out = 0 if soft else t.vocab_size
            target_phase = frozen_forward(
                t, n, a_t, hidden_kept=t.num_hidden_layers + 1, vocab_out=vocab_out, scores=step.target_scores
            )
            lse = min(n, vocab_map.LSE_CHUNK) * t.vocab_size * (a_t + F32)  # one chunk's logits of every token
            if soft:
                target_phase += n * vd * (a_t + F32) + vd * t.hidden_size * a_t + lse  # + the draft rows of lm_head
            else:
                target_phase += 2 * n * vd * F32 + lse
        return target_phase, n * config.hidden_size * a + n * (vd + 1) * F32

    def activation_bytes(self, step: PlannedStep) -> int:
        """The target phase against the training-time test's: each step the layer (2H attention input), its
        [B, S, Vd] logits, their float32 log-softmax and the product, and the target's own probabilities the acceptance
        is taken against (a loss other than ``kl`` keeps three more float32 [B, S, Vd] tensors for backward: the
        drafter's probabilities, their minimum with the target's and the renormalised labels); with ``recompute``
        each step's outputs and the last step with one recomputed in backward, else every step kept. Unfused
        (``attention: dense``, or ``auto`` off CUDA) each step also keeps its [S, S + i] scores per head
        (:func:`dense_scores`), one step's backward gradients of them in flight: quadratic in the sequence length."""
        n, a = step.tokens, step.element
        d = self.draft_layer_shape()
        target_phase, handed = self.target_phase_bytes(step, self.labels == "soft")
        copies = 3 if self.loss_spec.is_kl else 6
        steps = min(self.ttt_steps, step.seq - 1)
        scores = in_flight = 0
        if not step.fused(self.attention):  # [B, nh, S, S + i] per step
            heads = d.num_attention_heads // step.sequence_parallel  # Ulysses: each rank's heads, the whole row
            shape = (step.batch, heads, step.seq, step.seq + steps - 1)
            scores = dense_scores(*shape, a)
            in_flight = dense_scores(*shape, a, live=True) - scores
        one = layer_saved(d, n, a, extra_hidden=2) + scores + n * d.vocab_size * (a + copies * F32)
        if self.recompute:
            kept = (steps - 1) * n * (d.hidden_size + 2 * d.kv_width) * a  # each recomputed step's outputs
            return max(target_phase, handed + kept + one + one + in_flight)
        return max(target_phase, handed + steps * one + in_flight)

    def flops_per_token(self) -> float:
        drafter = 2.0 * count_params(self.drafter)
        if self.target_signals == "shards":
            return 3.0 * drafter * self.ttt_steps  # the target ran in precompute
        target = causal_lm_flops_per_token(self.target.model, 1024)
        return 3.0 * drafter * self.ttt_steps + target

    def drafter_record(self) -> DrafterRecord:
        architectures = getattr(self.target.config, "architectures", None) or []
        return eagle3_kind.make_record(self.drafter.config, self.target_path, architectures, self.ttt_steps)
