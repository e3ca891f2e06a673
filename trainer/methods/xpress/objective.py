"""XPress: train a DFlash drafter with XPress's causal refiner head (module.py, head.py) against a frozen target; the
objective of trainer/methods/dflash/objective.py with its block-refiner hooks (refiner.py there), trained as
speculators 0.9 trains ``XPressDraftModel``.

The step's loss is the sum of three kinds of slot losses of the trained slots (each one of DFlash's slot losses: the
recipe's ``labels``, ``loss`` and position weights; the refiner's bias through the slot loss's low-rank bias,
trainer/methods/dflash/slot_loss.py, which takes the head's gradients in forward):

- teacher-forced (``loss_tf``): the refined logits, ``lm_head(h_k) + readout(x_k)``, with the data's token before each
  slot's token as ``prev`` (slot 0's: the token before the anchor, or the anchor at a row's start);
- ``consistency_weight`` times the mean over ``consistency_passes`` free-running rounds (``loss_consistency_round<j>``):
  round 0 conditions on the drafter's own parallel argmax, round j on round j - 1's refined argmax (the anchor in slot
  0, no gradient through the argmax), which is the recurrence of the Jacobi passes that resolve a block when drafting;
- ``base_anchor_weight`` times the backbone's own logits' loss (``loss_base_anchor``), which keeps the Jacobi seed (the
  drafter's parallel argmax) from drifting; ``base_anchor_full_weight`` weighs its slots alike (their mean) instead of
  by position.

The head is read outside the drafter's forward, so FSDP2 and ZeRO-3 (which shard the drafter's weights outside its
forward) are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from trainer.interface.errors import RecipeError
from trainer.losses.chunked import RowLosses, Target, Term, chunked_loss, cross_entropy_rows, grad_times_weight
from trainer.losses.distribution import DEFAULT_ETA, distribution_rows
from trainer.methods.dflash.module import DFlashConfig
from trainer.methods.dflash.objective import DFlash
from trainer.methods.dflash.refiner import LogitBias, SlotTerm
from trainer.methods.dflash.slot_loss import ChunkLabels, Weights, slot_rows
from trainer.methods.xpress import kind as xpress_kind
from trainer.methods.xpress.head import check_refiner
from trainer.methods.xpress.module import REFINER_KEYS, XPressConfig, XPressDrafter
from trainer.models.block_attention import Impl
from trainer.training.activation_memory import PlannedStep
from trainer.training.objective import TargetSignals
from trainer.training.optimizers import Optim
from trainer.training.registry import DrafterRecord


@dataclass(eq=False)
class SharedPass:
    """One step's XPress terms, scored together (:meth:`XPress.shared_pass`).

    Attributes:
        blocks: [B, N, b, H] the drafter's normed outputs.
        teacher: [B, N, b] the data's token before each slot's token (slot 0's: the token before the anchor, or the
            anchor at its row's or document's start).
        idx: [n] the trained slots among the B * N * (b - 1).
        terms: the step's terms (their biases :class:`SharedBias` of this pass).
        losses: after the pass, each term's loss [] (the first's carrying the gradient of the step's sum).
        hits, accept: after the pass, the teacher-forced term's right-argmax flags [n] and acceptance rates [n].
    """

    blocks: torch.Tensor
    teacher: torch.Tensor
    idx: torch.Tensor
    terms: list[SlotTerm] = field(default_factory=list)
    losses: list[torch.Tensor] | None = None
    hits: torch.Tensor | None = None
    accept: torch.Tensor | None = None


@dataclass(eq=False)
class SharedBias:
    """The bias of an XPress term (a :class:`SlotTerm`'s): its kind in the step's :class:`SharedPass`.

    Attributes:
        step: the step's pass.
        kind: "tf" (the teacher-forced refined logits), "round" (a free-running round's, the rounds in order) or
            "base" (the backbone's own logits).
    """

    step: SharedPass
    kind: Literal["tf", "round", "base"]


class XPress(DFlash):
    """Trains an XPress drafter (a DFlash drafter with XPress's causal refiner) against an online frozen target, or
    from precomputed target shards."""

    drafter_class = XPressDrafter
    drafter: XPressDrafter
    _documents: torch.Tensor | None = None

    def __init__(
        self,
        target: str,
        num_draft_layers: int = 5,
        target_layers: list[int] | None = None,
        context_layers: int = 5,
        block_size: int = 16,
        mask_token_id: int | None = None,
        max_anchors: int = 512,
        gamma: float | None = None,
        position_weights: Literal["decay", "dpace"] = "decay",
        dpace_alpha: float = 0.5,
        labels: Literal["data", "argmax", "soft"] = "argmax",
        loss: Literal["kl", "tv", "nla", "lk_hybrid"] = "kl",
        lk_eta: float = DEFAULT_ETA,
        attention: Impl = "auto",
        loss_chunk_size: int = 1024,
        init_from: str | None = None,
        target_dtype: str = "float32",
        drafter_dtype: str = "float32",
        trust_remote_code: bool = False,
        seed: int = 0,
        target_signals: TargetSignals = "online",
        xpress_rank: int = 256,
        xpress_mlp_ratio: int = 2,
        num_jacobi_passes: int = 6,
        consistency_weight: float = 0.3,
        consistency_passes: int = 3,
        base_anchor_weight: float = 0.6,
        base_anchor_full_weight: bool = False,
        optim: Optim = Optim(),
    ) -> None:
        """The options of DFlash (trainer/methods/dflash/objective.py) and XPress's refiner and loss terms, whose
        defaults are speculators'.

        Args:
            target: the target, an HF causal LM directory or hub id.
            num_draft_layers: n, the drafter's transformer layers.
            target_layers: the target hidden states the context is made of, HF hidden_states indices (the input of
                layer i; z-lab's target_layer_ids + 1); None: z-lab's rule for ``context_layers`` layers.
            context_layers: m, the number of target layers read when ``target_layers`` is None.
            block_size: b, slots per block: the anchor and b - 1 drafts.
            mask_token_id: the id whose embedding fills the mask slots, one the tokenizer does not use; None: the
                tokenizer's mask token, else ``len(tokenizer)`` when the target's embedding has that row.
            max_anchors: the most blocks drawn per sequence.
            gamma: slot k's loss weight is exp(-(k - 1) / gamma) with ``position_weights: decay``; None: 7 at b = 16,
                4 at b = 8.
            position_weights: "decay" (the DFlash paper's fixed weights, ``gamma``) or "dpace" (D-PACE, from each
                term's own losses, slot_loss.block_dpace_weights); "dpace" needs token labels ("argmax" or "data").
            dpace_alpha: D-PACE's smoothing of each slot's confidence, ``(1 - a) * exp(-loss) + a``, in (0, 1].
            labels: "argmax" (the default) trains on the target's argmax, what greedy verification accepts; "data" on
                the rows' own tokens, "soft" on the target's distribution.
            loss: each slot's loss toward its label (trainer/losses/distribution.py): "kl", "tv", "nla" or "lk_hybrid",
                in every term (speculators' XPress default is the mixture 0.1 ce + 0.9 tv, which is not one of them).
            lk_eta: the hybrid's temperature eta.
            attention: the block-sparse attention: "flex" (CUDA), "dense", or "auto" (flex on CUDA).
            loss_chunk_size: slots projected to the vocabulary at a time (slot_loss.py).
            init_from: a training checkpoint or export of an XPress or DFlash drafter (or another block refiner's) to
                start from (its backbone; the refiner kept when it is an XPress one of the same shape).
            target_dtype: the target's weights dtype (float32, bfloat16, float16).
            drafter_dtype: the drafter's weights dtype.
            trust_remote_code: allow custom modelling code in the target directory (off by default).
            seed: seed of the drafter's initialisation and of the anchors.
            target_signals: "online" runs the target in every step; "shards" reads its hidden states of
                ``target_layers`` (and top-k next tokens, for soft labels) from a ShardDataModule, never building it.
            xpress_rank: r, the refiner's width (head.py). speculators uses 256, for vocabularies of 150k.
            xpress_mlp_ratio: the refiner's SwiGLU MLP is ``r * xpress_mlp_ratio`` wide.
            num_jacobi_passes: K, the parallel refine passes that resolve a block when drafting greedily (stored in
                the drafter's config and export; not used in training).
            consistency_weight: the weight of the free-running rounds' mean loss; 0: none.
            consistency_passes: the free-running rounds unrolled per step (round j on round j - 1's argmax).
            base_anchor_weight: the weight of the backbone's own logits' loss (the Jacobi seed's anchor); 0: none.
            base_anchor_full_weight: that term weighs the trained slots alike (their mean) instead of by position.
            optim: optimizer and learning-rate schedule.
        """
        try:
            check_refiner(xpress_rank, xpress_mlp_ratio, num_jacobi_passes)
        except ValueError as err:
            raise RecipeError(f"model.{err}") from err
        for key, value in (("consistency_weight", consistency_weight), ("base_anchor_weight", base_anchor_weight)):
            if not value >= 0:
                raise RecipeError(f"model.{key}={value} must be >= 0")
        if isinstance(consistency_passes, bool) or not isinstance(consistency_passes, int) or consistency_passes < 0:
            raise RecipeError(f"model.consistency_passes={consistency_passes!r} must be an integer >= 0")
        super().__init__(
            target,
            num_draft_layers=num_draft_layers,
            target_layers=target_layers,
            context_layers=context_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            max_anchors=max_anchors,
            gamma=gamma,
            position_weights=position_weights,
            dpace_alpha=dpace_alpha,
            labels=labels,
            loss=loss,
            lk_eta=lk_eta,
            attention=attention,
            loss_chunk_size=loss_chunk_size,
            init_from=init_from,
            target_dtype=target_dtype,
            drafter_dtype=drafter_dtype,
            trust_remote_code=trust_remote_code,
            seed=seed,
            target_signals=target_signals,
            optim=optim,
        )
        self.consistency_weight, self.consistency_passes = float(consistency_weight), consistency_passes
        self.base_anchor_weight, self.base_anchor_full_weight = float(base_anchor_weight), bool(base_anchor_full_weight)

    def drafter_config(self, config: DFlashConfig) -> XPressConfig:
        """The backbone's ``config`` with the recipe's refiner (``model.xpress_rank``...: this run's
        hyper-parameters)."""
        return XPressConfig(**config.to_dict(), **{key: self.hparams[key] for key in REFINER_KEYS})

    def drafter_record(self) -> DrafterRecord:
        architectures = getattr(self.target.config, "architectures", None) or []
        return xpress_kind.make_record(self.drafter.config, self.target_path, architectures)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.weights_are_sharded():
            raise RecipeError(
                "model.xpress_rank: XPress's refiner is read outside the drafter's forward, which FSDP2 and ZeRO-3 "
                "shard; train it with DDP or on one device"
            )
        self._documents = batch.get("document_ids")  # [B, S] or None: slot 0's previous token (slot_terms)
        try:
            return super().compute_loss(batch)
        finally:
            self._documents = None

    def slot_terms(
        self, blocks: torch.Tensor, anchors: torch.Tensor, ids: torch.Tensor, idx: torch.Tensor, prev: torch.Tensor
    ) -> list[SlotTerm]:
        """The teacher-forced refined logits' term, the free-running rounds' and the backbone's own (module
        docstring); blocks [B, N, b, H], anchors [B, N], ids [B, S], idx [n] (DFlash.slot_terms). Every term's bias
        is its place in the step's one :class:`SharedPass`, which :meth:`_slot_losses` runs for the first term."""
        B, N, b, _ = blocks.shape
        S = ids.shape[1]
        positions = anchors[:, :, None] + torch.arange(-1, b - 1, device=ids.device)  # [B, N, b]: slot k's prev
        start = anchors == 0  # the anchor itself at a row's start, or at its document's start
        if self._documents is not None:
            before = self._documents.gather(1, (anchors - 1).clamp(min=0))
            start = start | (before != self._documents.gather(1, anchors))
        positions[:, :, 0] = torch.where(start, anchors, anchors - 1)
        teacher = ids.gather(1, positions.clamp(max=S - 1).flatten(1)).view(B, N, b)  # [B, N, b]
        step = SharedPass(blocks, teacher, idx)
        terms = [SlotTerm(SharedBias(step, "tf"), name="tf")]
        if self.consistency_weight > 0 and self.consistency_passes > 0:
            scale = self.consistency_weight / self.consistency_passes  # the rounds' mean
            terms += [SlotTerm(SharedBias(step, "round"), scale=scale, name=f"consistency_round{j}")
                      for j in range(self.consistency_passes)]  # fmt: skip
        if self.base_anchor_weight > 0:
            terms.append(
                SlotTerm(
                    SharedBias(step, "base"),
                    scale=self.base_anchor_weight,
                    name="base_anchor",
                    uniform=self.base_anchor_full_weight,
                )
            )
        step.terms = terms
        return terms

    def _slot_losses(
        self,
        hidden: torch.Tensor,
        bias: LogitBias | SharedBias | None,
        weights: Weights,
        chunks: int | list[slice],
        ids: torch.Tensor,
        batch: dict[str, torch.Tensor],
        final: torch.Tensor | None,
        rows: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """DFlash's slot loss of a term (DFlash._slot_losses): for the first of the step's terms every term's, in
        the step's one shared pass (:meth:`shared_pass`, with the position weights ``weights``); the first term's
        loss carries the gradient of every term's (its value its own), a later term's is its loss, detached."""
        if not isinstance(bias, SharedBias):
            return super()._slot_losses(hidden, bias, weights, chunks, ids, batch, final, rows, positions)
        step = bias.step
        if step.losses is None:
            self.shared_pass(step, weights, ids, batch, final, rows, positions)
        term = next(j for j, t in enumerate(step.terms) if t.bias is bias)
        return step.losses[term], step.hits, step.accept

    def shared_pass(
        self,
        step: SharedPass,
        weights: Weights,
        ids: torch.Tensor,
        batch: dict[str, torch.Tensor],
        final: torch.Tensor | None,
        rows: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Every term's slot loss in one pass of the chunked-loss engine (trainer/losses/chunked.py) over the slots of
        the blocks that hold a trained slot, whole blocks a chunk: each chunk's slots are projected onto the
        vocabulary once, ``Z = h @ head.T``; every term scores ``Z`` plus its own rank-r bias (the backbone's term
        ``Z`` itself), the free-running rounds' argmax read from the rounds' own logits (the refiner's Jacobi
        passes, head.py, seeded by ``Z``'s argmax), and the terms' gradients with respect to the logits are summed
        into one, taken back through the head once. The biases' gradients (``G_t @ readout`` for each term's
        features, ``G_t.T @ x_t`` for the readout) are taken in the same pass, and reach the refiner's weights and
        the blocks through its features recomputed with autograd. Sets ``step.losses`` (the terms' losses, the first
        carrying the gradient of the step's weighted sum), ``step.hits`` and ``step.accept`` (the teacher-forced
        term's, as DFlash's slot loss gives them).

        Args:
            step: the step's blocks and terms (:meth:`slot_terms`).
            weights: the trained slots' position weights [n], or a function of a chunk's losses
                (DFlash.compute_loss: D-PACE, its chunks whole blocks, as these are).
            ids, batch, final, rows, positions: as DFlash._slot_losses (the labels).
        """
        refiner, b = self.drafter.refiner_head, self.drafter.config.block_size
        head = self.target.lm_head_weight.detach()  # [V, H]
        readout = refiner.readout.weight  # [V, r]
        idx, n = step.idx, step.idx.numel()
        block_of = idx // (b - 1)  # [n] each trained slot's block, of the B * N, non-decreasing
        active, inverse = torch.unique_consecutive(block_of, return_inverse=True)  # [A] blocks with a trained slot
        A, V = active.numel(), head.shape[0]
        local = inverse * (b - 1) + idx % (b - 1)  # [n] each trained slot's row among the A * (b - 1)
        blocks = step.blocks.flatten(0, 1)[active]  # [A, b, H]
        cache = refiner.hidden_cache(blocks)  # [A, b, 2r]
        teacher = step.teacher.flatten(0, 1)[active]  # [A, b]
        first = teacher[:, :2]  # [A, 2]: the token before the anchor, the anchor
        x_tf = refiner.features(teacher, cache)[:, 1:]  # [A, b - 1, r]
        cache_d, x_tf_d = cache.detach(), x_tf.detach()
        kinds = [t.bias.kind for t in step.terms]
        passes = kinds.count("round")
        per = max(1, self.loss_chunk_size // (b - 1))  # blocks a chunk
        block_parts = [slice(a, min(a + per, A)) for a in range(0, A, per)]
        edges = torch.searchsorted(inverse, torch.tensor([p.start for p in block_parts] + [A], device=idx.device))
        trained_parts = [slice(int(lo), int(hi)) for lo, hi in zip(edges[:-1], edges[1:])]
        chunk_of = {p.start * (b - 1): c for c, p in enumerate(block_parts)}
        labels = self._labels(ids, batch, final, rows, positions)
        score = slot_rows(self.loss_spec)  # the first term's, with the metrics' statistics
        later = cross_entropy_rows if self.loss_spec.is_kl else distribution_rows(self.loss_spec)
        mean = 1.0 / max(n, 1)
        sums = torch.zeros(len(kinds), dtype=torch.float32, device=idx.device)
        hits, accept = [], []
        want = torch.is_grad_enabled()
        prevs = [torch.empty_like(teacher) for _ in range(passes)]  # [A, b] each round's previous tokens
        grad_x = [torch.zeros_like(x_tf_d, dtype=torch.float32) for _ in range(1 + passes)] if want else []
        grad_readout = torch.zeros(readout.shape, dtype=torch.float32, device=readout.device) if want else None

        def chunk_loss(base: torch.Tensor, c: int, need_grad: bool) -> RowLosses:
            """Every term's weighted losses [C] summed per slot and their summed gradient [C, V] of the chunk's
            slots' logits ``base`` [C, V] (C = its blocks x (b - 1))."""
            part, tpart = block_parts[c], trained_parts[c]
            nb = part.stop - part.start
            at = local[tpart] - part.start * (b - 1)  # [Ct] the trained slots' rows in the chunk
            C = base.shape[0]
            every = torch.arange(C, device=at.device)  # [C]
            chunk_labels = labels(tpart)
            # Each term is scored on every slot of the chunk where its labels allow, an untrained slot's label any
            # token and its weight 0: no copy of the trained slots' logits, no scatter of their gradient back. Token
            # labels allow it; a distribution per trained slot (soft labels, and the first term's acceptance rates on
            # the steps whose metrics are logged) has the trained slots' logits scored alone.
            if chunk_labels.ids is not None:  # the later terms' loss: the token labels' alone (no acceptance)
                plain = Target(ids=chunk_labels.ids)
                padded = chunk_labels.ids.new_zeros(C).index_copy_(0, at, chunk_labels.ids)  # [C]
                every_row = [None if chunk_labels.want_accept else ChunkLabels(ids=padded), Target(ids=padded)]
            else:
                plain = Target(probs=chunk_labels.probs, sparse=chunk_labels.sparse)
                every_row = [None, None]
            if at.numel() == C:  # every slot trained (at is 0..C-1)
                every_row = [chunk_labels, plain]
            total = base.new_zeros(C)  # [C]
            summed: list[torch.Tensor] = []  # the chunk's gradient [C, V], the terms' summed as they come

            def term(j: int, logits: torch.Tensor, features: torch.Tensor | None, slot: int = -1) -> None:
                """Term j's losses of the trained slots of the chunk's ``logits`` [C, V] (overwritten), the rows of
                ``features`` [C, r] giving its bias (slot: where its features' gradient goes)."""
                target = every_row[min(j, 1)]
                alone = target is None  # scored on the trained slots alone
                rows = at if alone else every  # [R] the rows scored
                chosen = logits[at] if alone else logits  # [R, V]
                if j == 0:  # DFlash's slot loss, with the right-argmax flags and acceptance rates of the metrics
                    out = score(chosen, chunk_labels if alone else target, need_grad)
                    hits.append(out.stats[0] if alone else out.stats[0][at])
                    accept.append(out.stats[1] if alone or not out.stats[1].numel() else out.stats[1][at])
                else:
                    out = later(chosen, plain if alone else target, need_grad)
                loss = out.loss if alone else out.loss[at]  # [Ct] the trained slots'
                spec = step.terms[j]
                if spec.uniform:
                    w = torch.full_like(loss, mean)
                elif callable(weights):
                    w = weights(tpart, loss.detach())
                else:
                    w = weights[tpart]
                w = w.detach().to(loss.dtype)  # [Ct]
                sums[j] += (loss * w).sum().to(sums.dtype)
                total.index_add_(0, at, (loss * w * spec.scale).to(total.dtype))
                if not need_grad:
                    return
                scale = (w * spec.scale)[:, None]  # [Ct, 1]
                if not alone:  # every slot scored: an untrained one's gradient weighs 0
                    scale = scale.new_zeros(C, 1).index_copy_(0, at, scale)  # [C, 1]
                g = out.grad  # [R, V] the unweighted gradient
                if features is not None:  # the bias's gradients, weighted on the [R, r] side
                    grad_x[slot].view(-1, grad_x[slot].shape[-1]).index_add_(
                        0, rows + part.start * (b - 1), grad_times_weight(g, readout).float() * scale.float()
                    )
                    grad_readout.addmm_(g.t(), features[rows].float() * scale.float())
                scale = scale.to(g.dtype)
                if not summed:  # the first term: its gradient is the chunk's, in place where it covers every slot
                    summed.append(torch.zeros_like(base).index_add_(0, at, g.mul_(scale)) if alone else g.mul_(scale))
                elif alone:
                    summed[0].index_add_(0, at, g.mul_(scale))
                else:
                    summed[0].addcmul_(g, scale)

            blocks_z = base.view(nb, b - 1, V)  # [nb, b - 1, V]
            x = x_tf_d[part].flatten(0, 1)  # [C, r]
            rounds = refiner.jacobi(blocks_z, cache_d[part], first[part], passes)
            rnd = 0
            for j, kind in enumerate(kinds):
                if kind == "tf":
                    term(j, base + refiner.bias(x).float(), x, 0)
                elif kind == "round":
                    prev, features, logits = next(rounds)  # its argmax taken already: its logits are the loss's
                    prevs[rnd][part] = prev
                    rnd += 1
                    term(j, logits.flatten(0, 1), features.flatten(0, 1), rnd)
                else:
                    term(j, base, None)  # the last term: the chunk's projection itself
            if not need_grad:
                return RowLosses(total)
            return RowLosses(total, summed[0] if summed else torch.zeros_like(base))  # [C, V]

        hidden = step.blocks[:, :, 1:].flatten(0, 1)[active].flatten(0, 1)  # [A * (b - 1), H]
        out = chunked_loss(
            [Term(hidden, head)],
            chunk_loss,
            lambda part: chunk_of[part.start],
            None,  # the chunks' losses and gradients are weighted already (chunk_loss)
            chunks=[slice(p.start * (b - 1), p.stop * (b - 1)) for p in block_parts],
            dtype=torch.float32,
        )
        carried = out.total
        if want and n:  # the biases' gradients, through the refiner's features recomputed with autograd
            surrogate = (x_tf * grad_x[0].to(x_tf.dtype)).sum() + (readout * grad_readout.to(readout.dtype)).sum()
            for j in range(passes):
                features = refiner.features(prevs[j], cache)[:, 1:]  # [A, b - 1, r]
                surrogate = surrogate + (features * grad_x[j + 1].to(features.dtype)).sum()
            carried = carried + (surrogate - surrogate.detach())
        losses = list(sums.unbind())
        losses[0] = losses[0] + (carried - carried.detach()) / step.terms[0].scale
        step.losses = losses
        step.hits = torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool, device=idx.device)
        step.accept = torch.cat(accept) if accept else torch.zeros(0, device=idx.device)

    def activation_bytes(self, step: PlannedStep) -> int:
        """DFlash's estimate plus the refiner's tensors kept for backward over every slot of the sampled blocks: the
        hidden cache (2r a slot) once, and per refine pass (the teacher-forced one and each free-running round) the
        previous tokens' embedding, the projected and mixed features and the SwiGLU MLP's (about 6r + 3r * ratio)."""
        c = self.drafter.config
        slots = step.batch * min(self.max_anchors, step.seq) * c.block_size
        r = c.xpress_rank
        passes = 1 + (self.consistency_passes if self.consistency_weight > 0 else 0)
        refiner = slots * (2 * r + passes * (6 * r + 3 * r * c.xpress_mlp_ratio)) * step.element
        return super().activation_bytes(step) + refiner
