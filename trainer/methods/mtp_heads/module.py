"""Parallel multi-token-prediction heads (Gloeckle et al., 2024) on an HF Llama-like causal LM.

Layout. The model has ``L`` decoder layers. The trunk is the embedding and layers ``0 .. L - 2``; its output ``z`` is
HF's ``hidden_states[L - 1]`` (the input of the last layer). Head 0 is the model's own last layer, so trunk + head 0
+ final norm + lm_head is exactly the ordinary model (its export is the HF model itself). Heads ``1 .. n - 1`` are
extra decoder layers of the same class (``type(model.model.layers[-1])(config, L - 1)``), each reading ``z``. Every
head is followed by the shared final norm and lm_head: head ``i`` at position ``t`` predicts token ``t + 1 + i``.
The output scaling the model's forward applies after its lm_head (:attr:`MTPHeads.scaling`: Cohere's, Granite's
scales, Gemma-2's soft-cap; the identity for Llama) is part of that shared output layer: every head's logits, in the
loss and in drafting, are the scaled ones, as head 0's are the model's own.

Training loss: ``sum_i w_i * CE_i``, ``CE_i`` the mean cross entropy of head ``i`` over the positions whose token
``t + 1 + i`` is a trained label (``labels`` shifted by ``i``, the last ``i`` positions unlabelled). With ``distill``
(fine-tuning), ``CE_i`` is replaced by head ``i``'s forward KL from a frozen original's next-token distribution at
``t + i`` (its prediction of the same token) over the same positions: every head learns what the model it started
from predicts, not the data's tokens (:func:`head_soft_targets`); ``loss`` (trainer/losses/distribution.py) replaces
that KL by another loss toward the same distribution (``tv``, ``nla``, ``lk_hybrid``), and every head's expected
acceptance under it, ``sum_v min(p_v, q_v)``, is computed in the same chunked pass (:attr:`HeadsOutput.head_alpha`).

Three ways to run the heads' backward (:data:`HEAD_BACKWARDS`), all giving the naive gradients (tested in float64):

- ``sequential``: :class:`_SequentialHeads`, a custom ``autograd.Function`` whose forward runs each head's forward and
  backward in turn on *detached leaf copies* of ``z`` and of the head's, the norm's and the lm_head's parameters
  (``torch.func.functional_call``), accumulating d(loss)/dz and the parameter gradients, with the logits computed and
  freed a chunk of positions at a time (``trainer.losses.distillation.cross_entropy_with_grads``, on the chunked-loss
  engine of trainer/losses/chunked.py); its backward returns the stored gradients times ``grad_output``. The trunk then
  runs one backward. No gradient hook of DDP or DeepSpeed fires inside (the leaves are not the parameters), so they see
  one backward in which every parameter's gradient arrives once (the shared lm_head's summed over heads), with or
  without gradient accumulation. It reads parameters directly, so it needs whole parameters: DDP, ZeRO-1/2, one process.
- ``checkpoint``: for ZeRO-3 and FSDP2, where a parameter is only a shard outside its module's forward: every head's
  loss runs under ``torch.utils.checkpoint`` (``use_reentrant=False``) through the modules' own forwards, so each
  head's logits are freed after its forward and recomputed, one head at a time, in backward.
- ``naive``: plain autograd, every head's full logits alive until backward (the reference, and the benchmark's
  baseline).

Keeping the model's own outputs (``original``): when the model trains, its next-token distribution (trunk + head 0) can
be held close to a frozen copy of the model it started from, ``KL(p_original || q_head0)`` per position (forward KL, the
original's distribution first), averaged over the positions of a mask and returned beside the heads' loss
(:attr:`HeadsOutput.target_kl`; the objective weighs it). The logits are chunked over positions as every full-vocabulary
loss is (``trainer.losses.distillation.fused_kd_loss``): sequential backward and evaluation run head 0's layer and norm
once more through autograd and project a chunk of positions at a time; ``checkpoint`` and ``naive`` take head 0's logits
through the modules' own forwards (under activation checkpointing for ``checkpoint``) and ``kd_loss`` on them.

Drafting (:meth:`MTPHeads.draft_logits`): the extra heads read ``z`` of the committed positions from the target session;
each keeps its own KV cache over them. See proposer.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask

from trainer.decoding.session import slice_refusal
from trainer.losses.chunked import RowLosses, Term, chunked_loss, kl_from_log_probs
from trainer.losses.distillation import KL, SoftTargets, cross_entropy_with_grads, fused_kd_loss, kd_loss
from trainer.losses.distribution import DistributionLoss
from trainer.losses.distribution import loss_rows as distribution_loss_rows
from trainer.models.logit_scaling import LogitScaling

HEAD_BACKWARDS = ("sequential", "checkpoint", "naive")
IGNORE_INDEX = -100
ACCURACY_TOP_K = 10
"""Ranks of the measured agreement kept per extra head (the tree for a node budget is built from them)."""


def head_labels(labels: torch.Tensor, i: int) -> torch.Tensor:
    """Labels of head ``i`` from ``[B, S]`` next-token labels: position t gets ``labels[t + i]``, -100 past the end."""
    if i == 0:
        return labels
    return F.pad(labels[:, i:], (0, min(i, labels.shape[1])), value=IGNORE_INDEX)[:, : labels.shape[1]]  # [B, S]


def head_soft_targets(original: Original, i: int) -> SoftTargets:
    """What head ``i`` learns with ``distill``: at position t, the original's next-token distribution at t + i (its
    prediction of token t + 1 + i, the token head i guesses at t); past the end, zeros (unlabelled there)."""
    return SoftTargets(original.hidden, original.lm_head_weight, original.scaling).later(i)


@dataclass
class HeadInputs:
    """What a head needs besides ``z``: the attention mask, positions and rotary embeddings of the trunk's forward."""

    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]

    def kwargs(self) -> dict:
        return {
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
            "position_embeddings": self.position_embeddings,
        }


@dataclass
class HeadsOutput:
    """The loss of :meth:`MTPHeads.forward`.

    Attributes:
        loss: ``sum_i w_i * CE_i`` (scalar, float32; differentiable in training).
        head_losses: ``[n]`` the heads' mean cross entropies, detached.
        head_accuracy: ``[n]`` top-1 accuracy of every head against its labels (evaluation only, else None).
        agreement: ``[n - 1, R]`` evaluation only: how often the rank-r token of extra head i at position t is head 0's
            argmax at position t + i (the token greedy self-speculative decoding verifies), else None.
        agreement_count: positions counted in ``agreement`` (per extra head), else None.
        target_kl: ``KL(p_original || q_head0)`` averaged over the original's mask (scalar float32, differentiable in
            training) when ``original`` was given, else None; not part of ``loss``.
        head_alpha: ``[n]`` with ``distill``, every head's mean expected acceptance ``sum_v min(p_v, q_v)`` under the
            original's distribution over its labelled positions (detached), else None.
    """

    loss: torch.Tensor
    head_losses: torch.Tensor
    head_accuracy: torch.Tensor | None = None
    agreement: torch.Tensor | None = None
    agreement_count: torch.Tensor | None = None
    target_kl: torch.Tensor | None = None
    head_alpha: torch.Tensor | None = None


@dataclass
class Original:
    """The frozen original model head 0 is kept close to: its final normed hidden states and lm_head.

    Attributes:
        hidden: ``[B, S, Ho]`` the original's final normed hidden states on the batch (constants).
        lm_head_weight: ``[V, Ho]`` its output projection (constant).
        mask: ``[B, S]`` bool, the positions the KL is averaged over.
        scaling: the output scaling the original's forward applies after its lm_head (``FrozenTarget.logit_scaling``).
    """

    hidden: torch.Tensor
    lm_head_weight: torch.Tensor
    mask: torch.Tensor
    scaling: LogitScaling = LogitScaling()


class MTPHeads(nn.Module):
    """An HF causal LM (trunk and head 0) with ``num_heads - 1`` extra heads sharing its final norm and lm_head."""

    def __init__(
        self,
        model: PreTrainedModel,
        num_heads: int,
        head_init: Literal["copy", "random"] = "copy",
        accuracy_top_k: int = ACCURACY_TOP_K,
    ) -> None:
        """
        Args:
            model: the HF causal LM (a family whose decoder the target session runs itself: Llama, Mistral, Qwen2/3,
                Gemma, DeepSeek-V3 layouts with full attention).
            num_heads: n, the heads including head 0 (the model's last layer); n - 1 drafts per round.
            head_init: "copy": every extra head starts as a copy of the last layer (fine-tuning an existing model);
                "random": the model's own initialisation.
            accuracy_top_k: ranks kept in the measured agreement buffer (trees are built from it).
        """
        super().__init__()
        refusal = slice_refusal(model)
        if refusal is not None:
            raise ValueError(f"parallel MTP heads need a decoder run one layer at a time: {refusal}")
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1 (head 0 is the model's last layer), got {num_heads}")
        if head_init not in ("copy", "random"):
            raise ValueError(f"head_init={head_init!r} is not 'copy' or 'random'")
        self.model = model
        decoder = model.get_decoder()
        last = decoder.layers[-1]
        L = len(decoder.layers)
        heads = []
        for _ in range(num_heads - 1):
            layer = type(last)(model.config, L - 1)  # own KV cache when drafting: the last layer's index is safe
            if head_init == "copy":
                layer.load_state_dict(last.state_dict())
            else:
                layer.apply(model._init_weights)
            heads.append(layer.to(device=next(last.parameters()).device, dtype=next(last.parameters()).dtype))
        self.heads = nn.ModuleList(heads)
        self.register_buffer("agreement", torch.zeros(num_heads - 1, accuracy_top_k, dtype=torch.float32))
        self.register_buffer("agreement_count", torch.zeros((), dtype=torch.float32))

    # ---- shape -------------------------------------------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        """n, head 0 included."""
        return len(self.heads) + 1

    @property
    def num_layers(self) -> int:
        """L, the model's decoder layers (the trunk is the first L - 1)."""
        return len(self.model.get_decoder().layers)

    @property
    def hidden_layer(self) -> int:
        """The HF ``hidden_states`` index the heads read: L - 1, the input of the last layer."""
        return self.num_layers - 1

    @property
    def scaling(self) -> LogitScaling:
        """The output scaling the model's forward applies after its lm_head, shared by every head."""
        return LogitScaling.from_config(self.model.config)

    def head(self, i: int) -> nn.Module:
        """Head ``i``: the model's last layer for 0, else extra head ``i``."""
        return self.model.get_decoder().layers[-1] if i == 0 else self.heads[i - 1]

    def measured_agreement(self) -> torch.Tensor | None:
        """``[n - 1, R]`` the last measured top-k agreement of the extra heads (float64), or None if never measured."""
        if float(self.agreement_count) <= 0:
            return None
        return self.agreement.detach().double().cpu()

    # ---- forward pieces --------------------------------------------------------------------------------------------
    def trunk(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, HeadInputs]:
        """``[B, S]`` token ids -> ``z`` ``[B, S, H]`` (HF ``hidden_states[L - 1]``) and the heads' inputs."""
        decoder = self.model.get_decoder()
        h = decoder.embed_tokens(input_ids)  # [B, S, H]
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]  # [1, S]
        mask = create_causal_mask(
            config=decoder.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=position_ids
        )
        inputs = HeadInputs(mask, position_ids, decoder.rotary_emb(h, position_ids=position_ids))
        for layer in decoder.layers[:-1]:
            h = layer(h, **inputs.kwargs())  # [B, S, H]
        return h, inputs

    def head_logits(self, i: int, z: torch.Tensor, inputs: HeadInputs) -> torch.Tensor:
        """``[B, S, V]`` logits of head ``i`` through its module forwards (the naive and checkpoint paths)."""
        hidden = self.head(i)(z, **inputs.kwargs())  # [B, S, H]
        return self.scaling(self.model.lm_head(self.model.get_decoder().norm(hidden)))  # [B, S, V]

    def all_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, S, n, V]`` every head's logits (tests and small inputs only: n full-vocabulary tensors)."""
        z, inputs = self.trunk(input_ids)
        return torch.stack([self.head_logits(i, z, inputs) for i in range(self.num_heads)], dim=2)

    # ---- loss --------------------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        backward: Literal["sequential", "checkpoint", "naive"] = "sequential",
        chunk_size: int | None = 256,
        weights: Sequence[float] | None = None,
        measure: bool = False,
        original: Original | None = None,
        distill: bool = False,
        loss: DistributionLoss = KL,
    ) -> HeadsOutput:
        """The heads' loss on a batch (module docstring). Without grad mode (validation) the heads run one at a time,
        their logits a chunk at a time, whatever ``backward`` says.

        Args:
            input_ids: ``[B, S]`` tokens.
            labels: ``[B, S]`` next-token labels (-100 where not trained); head i uses them shifted by i.
            backward: how the heads' backward runs (:data:`HEAD_BACKWARDS`).
            chunk_size: positions per chunk of the logits (sequential backward and evaluation).
            weights: ``w_i`` per head (default all 1).
            measure: in evaluation, also the heads' accuracies and the extra heads' agreement with head 0.
            original: also ``target_kl``, head 0's KL from this frozen original (module docstring).
            distill: every head's loss is its forward KL from the original's distribution (:func:`head_soft_targets`)
                over the positions it has a label at, instead of its cross entropy on the labels (needs ``original``);
                ``target_kl`` is then not computed (head 0's loss is that KL over the labelled positions).
            loss: with ``distill``, the loss toward the original's distribution (trainer/losses/distribution.py; ``kl``
                is the forward KL above).
        """
        if backward not in HEAD_BACKWARDS:
            raise ValueError(f"backward={backward!r} is not one of {HEAD_BACKWARDS}")
        n = self.num_heads
        weights = [1.0] * n if weights is None else [float(w) for w in weights]
        if len(weights) != n:
            raise ValueError(f"{len(weights)} head weights for {n} heads")
        if tuple(labels.shape) != tuple(input_ids.shape):
            raise ValueError(f"labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} differ in shape")
        if distill and original is None:
            raise ValueError("distill needs the original's hidden states")
        if not (distill or loss.is_kl):
            raise ValueError(f"loss={loss.name!r} trains toward the original's distribution: it needs distill")
        z, inputs = self.trunk(input_ids)
        per_head = [head_labels(labels, i) for i in range(n)]
        soft = [head_soft_targets(original, i) if distill else None for i in range(n)]
        params = [p for p in self.parameters() if p.requires_grad]
        if not torch.is_grad_enabled() or not (z.requires_grad or params):
            out = self._evaluate(z, inputs, per_head, soft, weights, chunk_size, measure, loss)
            if original is not None and not distill:
                out.target_kl = self.target_kl(z, inputs, original, "sequential", chunk_size)
            return out
        kl = None if original is None or distill else self.target_kl(z, inputs, original, backward, chunk_size)
        if backward == "sequential":
            plan = _Plan(self, inputs, per_head, soft, weights, chunk_size, loss)
            total, losses, alphas = _SequentialHeads.apply(plan, z, *plan.params)
            return HeadsOutput(loss=total, head_losses=losses, target_kl=kl, head_alpha=alphas if distill else None)
        losses, alphas = [], []
        for i in range(n):
            if backward == "checkpoint":
                out = checkpoint(self._head_loss, i, z, inputs, per_head[i], soft[i], loss, use_reentrant=False)
            else:
                out = self._head_loss(i, z, inputs, per_head[i], soft[i], loss)
            losses.append(out[0])
            alphas.append(out[1].detach())
        total = sum(w * loss_i for w, loss_i in zip(weights, losses))
        return HeadsOutput(loss=total, head_losses=torch.stack([x.detach() for x in losses]), target_kl=kl,
                           head_alpha=torch.stack(alphas) if distill else None)  # fmt: skip

    def target_kl(
        self, z: torch.Tensor, inputs: HeadInputs, original: Original, backward: str, chunk_size: int | None
    ) -> torch.Tensor:
        """``KL(p_original || q_head0)`` averaged over ``original.mask``, from the trunk output ``z`` ``[B, S, H]``.

        ``sequential`` (and evaluation): head 0's layer and the norm through autograd, the logits of both models a
        chunk of positions at a time (``fused_kd_loss``, which reads the lm_head weight: whole parameters only);
        ``checkpoint`` and ``naive``: head 0's logits through the modules' forwards, checkpointed for ``checkpoint``."""
        if backward == "sequential" or not torch.is_grad_enabled():
            normed = self.model.get_decoder().norm(self.head(0)(z, **inputs.kwargs()))  # [B, S, H]
            return fused_kd_loss(
                normed, self.model.lm_head.weight, original.hidden, original.lm_head_weight, original.mask,
                chunk_size=chunk_size, student_scaling=self.scaling, teacher_scaling=original.scaling,
            ).loss  # fmt: skip
        if backward == "checkpoint":
            return checkpoint(self._target_kl_modules, z, inputs, original, chunk_size, use_reentrant=False)
        return self._target_kl_modules(z, inputs, original, chunk_size)

    def _target_kl_modules(
        self, z: torch.Tensor, inputs: HeadInputs, original: Original, chunk_size: int | None
    ) -> torch.Tensor:
        """:meth:`target_kl` from head 0's full logits through the modules' own forwards (sharded weights)."""
        logits = self.head_logits(0, z, inputs)  # [B, S, V]
        reference = head_soft_targets(original, 0).logits()  # [B, S, V]
        return kd_loss(logits, reference, original.mask, chunk_size=chunk_size).loss

    def _head_loss(
        self,
        i: int,
        z: torch.Tensor,
        inputs: HeadInputs,
        labels: torch.Tensor,
        soft: SoftTargets | None,
        loss: DistributionLoss = KL,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean cross entropy of head ``i`` from its full logits, widened to float32, or with ``soft`` its mean
        ``loss`` toward their distribution over the labelled positions (0 when it has no label); and with ``soft`` the
        mean acceptance there (detached; else 0)."""
        logits = self.head_logits(i, z, inputs)  # [B, S, V]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        labelled = labels != IGNORE_INDEX  # [B, S]
        none = logits.new_zeros(())
        if soft is not None:
            if not bool(labelled.any()):
                return logits.sum() * 0.0, none
            out = kd_loss(logits, soft.logits(), labelled, loss=loss.name, lk_eta=loss.eta)  # soft.logits(): [B, S, V]
            return out.loss, out.alpha.to(none.dtype)
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        return total / max(1, int(labelled.sum())), none

    @torch.no_grad()
    def _evaluate(
        self,
        z: torch.Tensor,
        inputs: HeadInputs,
        per_head: list[torch.Tensor],
        soft: list[SoftTargets | None],
        weights: list[float],
        chunk_size: int | None,
        measure: bool,
        loss: DistributionLoss = KL,
    ) -> HeadsOutput:
        """Every head's loss (and accuracies), one head and one chunk of logits at a time, without gradients: the cross
        entropy on its labels, or its ``loss`` toward ``soft[i]`` where given, with its acceptance (the accuracies are
        against the labels)."""
        n, top_k = self.num_heads, self.agreement.shape[1]
        weight = self.model.lm_head.weight  # [V, H]
        norm = self.model.get_decoder().norm
        compute = torch.promote_types(z.dtype, torch.float32)
        losses = torch.zeros(n, dtype=compute, device=z.device)
        accuracy = torch.zeros(n, dtype=torch.float32, device=z.device)
        alphas = torch.zeros(n, dtype=compute, device=z.device)
        agreement = torch.zeros(max(0, n - 1), top_k, dtype=torch.float64, device=z.device)
        counts = torch.zeros(max(0, n - 1), dtype=torch.float64, device=z.device)
        argmax0 = None
        for i in range(n):
            normed = norm(self.head(i)(z, **inputs.kwargs())).flatten(0, 1)  # [B*S, H]
            labels = per_head[i].flatten()  # [B*S]
            reference = None
            if i > 0 and measure:
                reference = head_labels(argmax0.view_as(per_head[0]), i).flatten()  # [B*S]
                reference = torch.where(labels != IGNORE_INDEX, reference, IGNORE_INDEX)
            wanted = labels != IGNORE_INDEX  # [B*S]
            if i == 0 and measure:
                wanted = torch.ones_like(wanted)  # head 0's argmax everywhere: the extra heads' references
            rows = torch.nonzero(wanted).squeeze(-1)  # [N]
            targets = _EvalTargets(
                rows, labels[rows], None if reference is None else reference[rows], soft[i], compute, loss
            )
            out = chunked_loss(
                [Term(normed, weight)], _evaluation_rows, targets, (labels[rows] != IGNORE_INDEX).to(compute),
                chunks=chunk_size, index=rows, scaling=self.scaling, dtype=compute,
            )  # fmt: skip
            if i == 0:
                argmax0 = torch.full_like(labels, IGNORE_INDEX)  # [B*S]
            if not out.stats:  # no row to score
                continue
            guess, hits, ranks, accept = out.stats  # [N] each: the argmax, right (labelled rows), rank of the
            # reference (or -1), acceptance under soft[i] (0 without)
            count = int((labels[rows] != IGNORE_INDEX).sum())
            alphas[i] = accept.sum() / max(1, count)
            if i == 0:
                argmax0.index_copy_(0, rows, guess)
            losses[i] = out.total / max(1, count)
            accuracy[i] = float(hits.sum()) / max(1, count)
            if reference is not None:
                ranked = ranks[ranks >= 0]
                agreement[i - 1] += torch.bincount(ranked[ranked < top_k], minlength=top_k).double()
                counts[i - 1] += ranked.numel()
        total = sum(w * losses[i] for i, w in enumerate(weights))
        head_alpha = alphas if soft and soft[0] is not None else None
        if not measure:
            return HeadsOutput(loss=total, head_losses=losses, head_alpha=head_alpha)
        return HeadsOutput(loss=total, head_losses=losses, head_accuracy=accuracy, agreement=agreement,
                           agreement_count=counts, head_alpha=head_alpha)  # fmt: skip

    # ---- drafting ----------------------------------------------------------------------------------------------------
    def new_caches(self) -> list[DynamicCache]:
        """One empty KV cache per extra head (each head's layer index is the last layer's, in its own cache)."""
        return [DynamicCache() for _ in self.heads]

    @torch.no_grad()
    def draft_logits(self, z: torch.Tensor, start: int, caches: list[DynamicCache]) -> torch.Tensor:
        """Append ``[n, H]`` trunk outputs of positions ``start .. start + n - 1`` to every extra head's cache; the
        extra heads' logits at the last of them: ``[n_heads - 1, V]`` (row d guesses the token d + 1 after the next)."""
        decoder = self.model.get_decoder()
        h = z[None].to(self.model.dtype)  # [1, n, H]
        n = h.shape[1]
        position_ids = (start + torch.arange(n, device=h.device))[None]  # [1, n]
        allowed = torch.ones(n, start + n, dtype=torch.bool, device=h.device).tril(start)  # [n, start + n]
        mask = torch.zeros(allowed.shape, dtype=h.dtype, device=h.device)
        mask = mask.masked_fill(~allowed, torch.finfo(h.dtype).min)[None, None]  # [1, 1, n, start + n]
        rotary = decoder.rotary_emb(h, position_ids=position_ids)
        last = []
        for head, cache in zip(self.heads, caches):
            out = head(h, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True,
                       position_embeddings=rotary)  # fmt: skip
            last.append(out[0, -1])  # [H]
        return self.scaling(self.model.lm_head(decoder.norm(torch.stack(last))))  # [n_heads - 1, V]

    def record_agreement(self, agreement: torch.Tensor, counts: torch.Tensor) -> None:
        """Store measured agreement sums ``[n - 1, R]`` over ``[n - 1]`` positions as rates."""
        if counts.numel() and float(counts.min()) > 0:
            self.agreement.copy_((agreement / counts[:, None]).to(self.agreement))
            self.agreement_count.fill_(float(counts.min()))


@dataclass
class _EvalTargets:
    """What :meth:`MTPHeads._evaluate` scores a head's rows against, chunk by chunk (:func:`_evaluation_rows`)."""

    rows: torch.Tensor  # [N] flat positions of the rows scored
    labels: torch.Tensor  # [N] the head's labels there (-100: not labelled, scored only for its argmax)
    reference: torch.Tensor | None  # [N] head 0's argmax at t + i (-100: none), or None: no agreement measured
    soft: SoftTargets | None  # the original's distribution in place of the labels' tokens, or None
    dtype: torch.dtype  # the compute dtype
    loss: DistributionLoss = KL  # the loss toward ``soft``

    def __call__(self, part: slice) -> tuple:
        """A chunk's labels [C], references [C] (or None), with soft targets the original's log-probabilities [c, V]
        on its labelled rows (else None), and the loss toward them."""
        labels = self.labels[part]
        reference = None if self.reference is None else self.reference[part]
        if self.soft is None:
            return labels, reference, None, self.loss
        lp = self.soft.log_probs(self.rows[part][labels != IGNORE_INDEX], self.dtype)  # [c, V]
        return labels, reference, lp, self.loss


def _evaluation_rows(logits: torch.Tensor, target: tuple, need_grad: bool) -> RowLosses:
    """Per row of an evaluated head: the cross entropy of its label (or its loss toward the original's distribution;
    0 where unlabelled) and, as statistics, its argmax, whether that is the label, the rank of head 0's token (-1
    where none) and its acceptance under the original's distribution (0 without one). logits: [C, V]; target:
    :meth:`_EvalTargets.__call__`'s."""
    labels, reference, teacher, spec = target
    valid = labels != IGNORE_INDEX  # [C]
    guess = logits.argmax(-1)  # [C]
    loss = logits.new_zeros(labels.shape[0])  # [C]
    accept = logits.new_zeros(labels.shape[0])  # [C]
    if bool(valid.any()):
        scored = logits[valid]  # [c, V]
        lse = torch.logsumexp(scored, dim=-1)  # [c]
        if teacher is None:
            loss[valid] = lse - scored.gather(-1, labels[valid][:, None])[:, 0]
        else:
            lq = scored - lse[:, None]  # [c, V]
            if spec.is_kl:
                loss[valid] = kl_from_log_probs(teacher, lq)
            else:
                loss[valid] = distribution_loss_rows(scored, teacher.exp(), spec, want_kl=False)[0]
            accept[valid] = torch.minimum(lq.exp(), teacher.exp()).sum(-1)
    ranks = torch.full_like(labels, -1)  # [C]
    if reference is not None:
        ok = reference != IGNORE_INDEX  # [C]
        if bool(ok.any()):
            ref_logit = logits[ok].gather(-1, reference[ok][:, None])  # [c, 1]
            ranks[ok] = (logits[ok] > ref_logit).sum(-1)  # [c]: the rank of head 0's token in head i
    return RowLosses(loss, None, (guess, (guess == labels) & valid, ranks, accept))


class _Plan:
    """The heads' forward in :class:`_SequentialHeads`: modules, where their parameters sit in the flat list, labels."""

    def __init__(
        self,
        heads: MTPHeads,
        inputs: HeadInputs,
        labels: list[torch.Tensor],
        soft_targets: list[SoftTargets | None],
        weights: list[float],
        chunk_size: int | None,
        loss: DistributionLoss = KL,
    ) -> None:
        self.inputs, self.labels, self.weights, self.chunk_size = inputs, labels, weights, chunk_size
        self.loss = loss
        self.soft_targets = soft_targets
        self.modules = [heads.head(i) for i in range(heads.num_heads)]
        self.norm = heads.model.get_decoder().norm
        self.unembedding = heads.model.lm_head.weight  # [V, H]
        self.scaling = heads.scaling
        self.params: list[nn.Parameter] = []
        index: dict[int, int] = {}

        def slot(p: nn.Parameter) -> int:
            if id(p) not in index:
                index[id(p)] = len(self.params)
                self.params.append(p)
            return index[id(p)]

        self.head_slots = [{name: slot(p) for name, p in m.named_parameters()} for m in self.modules]
        self.norm_slots = {name: slot(p) for name, p in self.norm.named_parameters()}
        self.unembedding_slot = slot(self.unembedding)


class _SequentialHeads(torch.autograd.Function):
    """Forward: each head's forward and backward in turn on detached leaves; backward: the stored gradients scaled."""

    @staticmethod
    def forward(ctx, plan: _Plan, z: torch.Tensor, *params: torch.Tensor):
        need_z = ctx.needs_input_grad[1]
        needs = ctx.needs_input_grad[2:]
        z_leaf = z.detach().requires_grad_(need_z)
        leaves = [p.detach().requires_grad_(need) for p, need in zip(params, needs)]
        u = plan.unembedding_slot
        g_z = torch.zeros_like(z) if need_z else None
        g_params = [torch.zeros_like(p) if need and s != u else None for s, (p, need) in enumerate(zip(params, needs))]
        if needs[u]:  # summed over the heads in the logits' compute dtype (float32 for half-precision weights)
            g_params[u] = torch.zeros_like(params[u], dtype=torch.promote_types(params[u].dtype, torch.float32))
        norm_leaves = {name: leaves[s] for name, s in plan.norm_slots.items()}
        losses, alphas = [], []
        for i, module in enumerate(plan.modules):
            # the head and the norm run with autograd on the leaves; the logits' part is taken chunk by chunk
            slots = [s for s in plan.head_slots[i].values() if needs[s] and s != u]
            slots += [s for s in plan.norm_slots.values() if needs[s] and s not in slots]
            wrt = ([z_leaf] if need_z else []) + [leaves[s] for s in slots]
            with torch.set_grad_enabled(bool(wrt)):
                head_leaves = {name: leaves[s] for name, s in plan.head_slots[i].items()}
                hidden = functional_call(module, head_leaves, (z_leaf,), plan.inputs.kwargs())  # [B, S, H]
                normed = functional_call(plan.norm, norm_leaves, (hidden,))  # [B, S, H]
            # g_normed [B, S, H]; the lm_head's gradient added to g_params[u]
            loss, g_normed, _, alpha = cross_entropy_with_grads(
                normed, leaves[u], plan.labels[i], plan.chunk_size, bool(wrt), needs[u], plan.weights[i], g_params[u],
                scaling=plan.scaling, soft_targets=plan.soft_targets[i], loss=plan.loss,
            )  # fmt: skip
            alphas.append(loss.new_zeros(()) if alpha is None else alpha.to(loss.dtype))
            if wrt:
                grads = torch.autograd.grad(normed, wrt, grad_outputs=g_normed)
                if need_z:
                    g_z += grads[0]
                for s, g in zip(slots, grads[len(grads) - len(slots) :]):
                    g_params[s] += g
                del grads
            losses.append(loss.detach())
            del hidden, normed, g_normed
        if needs[u]:
            g_params[u] = g_params[u].to(params[u].dtype)
        ctx.grads = (g_z, g_params)
        losses, alphas = torch.stack(losses), torch.stack(alphas)  # [n] each
        total = sum(w * losses[i] for i, w in enumerate(plan.weights))
        ctx.mark_non_differentiable(losses, alphas)
        return total, losses, alphas

    @staticmethod
    def backward(ctx, grad_total, _grad_losses, _grad_alphas):
        # scaled in place and handed over (no copy: the optimizer's gradients may take these very tensors)
        g_z, g_params = ctx.grads
        ctx.grads = None
        scaled = [None if g is None else g.mul_(grad_total.to(g.dtype)) for g in g_params]
        return None, None if g_z is None else g_z.mul_(grad_total.to(g_z.dtype)), *scaled


def default_accuracy(num_drafts: int, top_k: int) -> torch.Tensor:
    """A prior ``[K, k]`` top-k accuracy for trees when none was measured: head d's rank-r token is right with
    probability ``0.6 ** (d + 1) * 0.5 ** r`` (deeper heads and lower ranks less often), so tree_for_budget spends a
    budget on the first heads' alternatives and on the argmax chain."""
    depth = torch.arange(num_drafts, dtype=torch.float64)[:, None]
    rank = torch.arange(top_k, dtype=torch.float64)[None]
    return 0.6 ** (depth + 1) * 0.5**rank
