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

from typing import Literal

import torch

from trainer.interface.errors import RecipeError
from trainer.losses.distribution import DEFAULT_ETA
from trainer.methods.dflash.module import DFlashConfig
from trainer.methods.dflash.objective import DFlash
from trainer.methods.dflash.refiner import LogitBias, SlotTerm
from trainer.methods.xpress import kind as xpress_kind
from trainer.methods.xpress.head import check_refiner
from trainer.methods.xpress.module import REFINER_KEYS, XPressConfig, XPressDrafter
from trainer.models.block_attention import Impl
from trainer.training.activation_memory import PlannedStep
from trainer.training.objective import TargetSignals
from trainer.training.optimizers import Optim
from trainer.training.registry import DrafterRecord


class XPress(DFlash):
    """Trains an XPress drafter (a DFlash drafter with XPress's causal refiner) against an online frozen target, or
    from precomputed target shards."""

    drafter_class = XPressDrafter
    drafter: XPressDrafter

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
        return super().compute_loss(batch)

    def slot_terms(
        self, blocks: torch.Tensor, anchors: torch.Tensor, ids: torch.Tensor, idx: torch.Tensor, prev: torch.Tensor
    ) -> list[SlotTerm]:
        """The teacher-forced refined logits' term, the free-running rounds' and the backbone's own (module
        docstring); blocks [B, N, b, H], anchors [B, N], ids [B, S], idx [n] (DFlash.slot_terms)."""
        refiner = self.drafter.refiner_head
        B, N, b, _ = blocks.shape
        S = ids.shape[1]
        positions = anchors[:, :, None] + torch.arange(-1, b - 1, device=ids.device)  # [B, N, b]: slot k's prev
        positions[:, :, 0] = torch.where(anchors > 0, anchors - 1, anchors)  # the anchor itself at a row's start
        teacher = ids.gather(1, positions.clamp(max=S - 1).flatten(1)).view(B, N, b)  # [B, N, b]
        cache = refiner.hidden_cache(blocks)  # [B, N, b, 2r]

        def trained(features: torch.Tensor) -> LogitBias:
            """The bias of the trained slots from every slot's features [B, N, b, r]."""
            return LogitBias(features[:, :, 1:].flatten(0, 2)[idx], refiner.readout.weight)  # [n, r]

        terms = [SlotTerm(trained(refiner.features(teacher, cache)), name="tf")]
        if self.consistency_weight > 0 and self.consistency_passes > 0:
            head = self.target.lm_head_weight.detach()  # [V, H]
            guess = self._argmax(blocks.detach(), head)  # [B, N, b]: the drafter's parallel argmax
            for j in range(self.consistency_passes):
                guess[:, :, 0] = ids.gather(1, anchors)  # slot 0 is the anchor
                features = refiner.features(torch.cat([teacher[:, :, :1], guess[:, :, :-1]], dim=-1), cache)
                scale = self.consistency_weight / self.consistency_passes  # the rounds' mean
                terms.append(SlotTerm(trained(features), scale=scale, name=f"consistency_round{j}"))
                if j + 1 < self.consistency_passes:
                    guess = self._argmax(blocks.detach(), head, features.detach())
        if self.base_anchor_weight > 0:
            terms.append(
                SlotTerm(None, scale=self.base_anchor_weight, name="base_anchor", uniform=self.base_anchor_full_weight)
            )
        return terms

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

    @torch.no_grad()
    def _argmax(self, blocks: torch.Tensor, head: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        """The argmax [B, N, b] of every slot's logits, ``blocks [B, N, b, H] @ head.T`` plus the refiner's bias of
        ``features`` [B, N, b, r] when given, ``loss_chunk_size`` slots at a time."""
        flat = blocks.flatten(0, 2)  # [M, H]
        rows = None if features is None else features.flatten(0, 2)  # [M, r]
        out = []
        for start in range(0, flat.shape[0], self.loss_chunk_size):
            part = slice(start, start + self.loss_chunk_size)
            logits = flat[part] @ head.t().to(flat.dtype)  # [C, V]
            if rows is not None:
                logits = logits + self.drafter.refiner_head.bias(rows[part]).to(logits.dtype)
            out.append(logits.argmax(-1))
        return torch.cat(out).view(blocks.shape[:3])
