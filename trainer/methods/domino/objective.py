"""Domino: train a DFlash drafter with Domino's causal correction head (module.py) against a frozen target; the
objective of trainer/methods/dflash/objective.py with its block-refiner hooks (refiner.py there).

Each trained slot k's logits gain the head's delta (module.py) from the GRU's state after the block's tokens before
slot k's (teacher forcing: the data's tokens, as SpecForge trains it), through the slot loss's low-rank bias
(trainer/methods/dflash/slot_loss.py ``LogitBias``), which takes the head's gradients in forward. The GRU runs once
per block over the block's first ``b - 1`` tokens (a slot reads the state after its own prefix; the GRU is causal,
so tokens past a slot never reach it).

The loss is the base-anchor curriculum of SpecForge's ``OnlineDominoModel``: two slot losses of the same slots, the
corrected logits' (``final``) and the backbone's own (``base``), each with DFlash's position weights and labels,

    loss = (1 - lambda) * final + lambda * base,

``lambda`` decaying linearly from ``lambda_base_start`` at step 0 to 0 at ``lambda_base_decay_ratio`` of the run's
optimizer steps (``trainer.max_steps``, else Lightning's estimate), then 0 (:func:`base_weight`, SpecForge's
``linear_lambda_base``; a run without a known length trains ``final`` alone, as there). Early steps keep the parallel
backbone a good drafter on its own; later ones hand the slots to the head. The base term is skipped once ``lambda``
is 0. Logged: ``loss_final``, ``loss_base`` (while computed) and ``lambda_base``; ``acc_k``, ``prefix_k`` and
``block_tau`` are the corrected logits'.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from trainer.interface.errors import RecipeError
from trainer.losses.distribution import DEFAULT_ETA
from trainer.methods.dflash.module import DFlashConfig
from trainer.methods.dflash.objective import DFlash
from trainer.methods.dflash.refiner import LogitBias, SlotTerm
from trainer.methods.domino import kind as domino_kind
from trainer.methods.domino.module import HEAD_KEYS, DominoConfig, DominoDrafter, check_head
from trainer.models.block_attention import Impl
from trainer.training.objective import TargetSignals
from trainer.training.optimizers import Optim
from trainer.training.registry import DrafterRecord


def base_weight(step: int, total_steps: int, start: float, decay_ratio: float) -> float:
    """The base loss's weight lambda at optimizer step ``step`` of ``total_steps``: ``start`` decaying linearly to 0
    over the first ``max(1, int(total_steps * decay_ratio))`` steps, then 0, clamped to [0, 1]; 0 without a known
    length (``total_steps`` <= 0)."""
    if total_steps <= 0:
        return 0.0
    decay_steps = max(1, int(total_steps * decay_ratio))
    progress = min(step / decay_steps, 1.0)
    return max(0.0, min(1.0, start * (1.0 - progress)))


class Domino(DFlash):
    """Trains a DFlash drafter with Domino's correction head under the base-anchor curriculum."""

    drafter_class = DominoDrafter
    drafter: DominoDrafter

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
        emb_dim: int = 256,
        gru_hidden_dim: int = 1024,
        pure_draft_prefix_len: int = 1,
        lambda_base_start: float = 1.0,
        lambda_base_decay_ratio: float = 0.5,
        optim: Optim = Optim(),
    ) -> None:
        """
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
            position_weights: "decay" (fixed weights, ``gamma``) or "dpace" (D-PACE, from the drafter's own losses in
                the step; needs token labels).
            dpace_alpha: D-PACE's smoothing of each slot's confidence, ``(1 - a) * exp(-loss) + a``, in (0, 1].
            labels: "argmax" (the default) trains on the target's argmax (cross entropy), what greedy verification
                accepts; "data" on the rows' own tokens, "soft" on the target's distribution (KL).
            loss: each slot's loss toward its label, in both terms of the curriculum (trainer/losses/distribution.py):
                "kl" (KL(p || q); the cross entropy with token labels, SpecForge's), "tv" (1 - alpha, alpha =
                sum_v min(p_v, q_v) the expected acceptance), "nla" (-log alpha) or "lk_hybrid" (lambda * KL +
                (1 - lambda) * TV, lambda = exp(-lk_eta * alpha)). "dpace" needs "kl".
            lk_eta: the hybrid's temperature eta (3, the LK paper's and speculators' default).
            attention: the block-sparse attention: "flex" (CUDA), "dense", or "auto" (flex on CUDA).
            loss_chunk_size: slots projected to the vocabulary at a time (slot_loss.py).
            init_from: a training checkpoint or export of a Domino or DFlash drafter (or another refiner's) to start
                from (its weights and shape; the head kept when it is its own of the same shape, else a new one).
            target_dtype: the target's weights dtype (float32, bfloat16, float16).
            drafter_dtype: the drafter's weights dtype.
            trust_remote_code: allow custom modelling code in the target directory (off by default).
            seed: seed of the drafter's initialisation and of the anchors.
            target_signals: "online" runs the target in every step; "shards" reads its hidden states of
                ``target_layers`` (and top-k next tokens, for soft labels) from a ShardDataModule, never building it.
            emb_dim: e, the rank of the head's logit delta (SpecForge's Qwen3-8B drafter: 256).
            gru_hidden_dim: G, the GRU's state width (SpecForge's Qwen3-8B drafter: 1024).
            pure_draft_prefix_len: the leading slots drafted from the backbone's logits alone (SpecForge's published
                config and SGLang's rollout: 1).
            lambda_base_start: the base loss's weight at step 0, in [0, 1] (SpecForge's default 1.0).
            lambda_base_decay_ratio: the fraction of the run's optimizer steps over which that weight decays to 0, in
                (0, 1] (SpecForge's default 0.5; its Qwen3-8B example uses 1.0).
            optim: optimizer and learning-rate schedule.
        """
        if not 0.0 <= lambda_base_start <= 1.0:
            raise RecipeError(f"model.lambda_base_start={lambda_base_start} must be in [0, 1]")
        if not 0.0 < lambda_base_decay_ratio <= 1.0:
            raise RecipeError(f"model.lambda_base_decay_ratio={lambda_base_decay_ratio} must be in (0, 1]")
        try:
            check_head(emb_dim, gru_hidden_dim, pure_draft_prefix_len, block_size)
        except ValueError as err:
            raise RecipeError(f"model.{err}") from err
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
        self.lambda_start, self.lambda_decay_ratio = float(lambda_base_start), float(lambda_base_decay_ratio)

    def drafter_config(self, config: DFlashConfig) -> DominoConfig:
        """The backbone's ``config`` with the recipe's head (``model.emb_dim``...: this run's hyper-parameters)."""
        try:
            return DominoConfig(**config.to_dict(), **{key: self.hparams[key] for key in HEAD_KEYS})
        except ValueError as err:  # the head against init_from's block size
            raise RecipeError(f"model.{err}") from err

    def drafter_record(self) -> DrafterRecord:
        architectures = getattr(self.target.config, "architectures", None) or []
        return domino_kind.make_record(self.drafter.config, self.target_path, architectures)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.weights_are_sharded():
            raise RecipeError(
                "model.class_path Domino: the correction head is read outside the drafter's forward, which FSDP2 and "
                "ZeRO-3 shard; train it with DDP or on one device"
            )
        return super().compute_loss(batch)

    # ---- the curriculum ----------------------------------------------------------------------------------------------
    def schedule_position(self) -> tuple[int, int]:
        """(the optimizer step, the run's optimizer steps; 0 when unknown or outside a run)."""
        if self._trainer is None:
            return 0, 0
        trainer = self.trainer
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else 0
        if total <= 0:
            estimated = trainer.estimated_stepping_batches
            total = 0 if math.isinf(estimated) else int(estimated)
        return int(trainer.global_step), total

    def lambda_base(self) -> float:
        """This step's base-loss weight (:func:`base_weight`)."""
        step, total = self.schedule_position()
        return base_weight(step, total, self.lambda_start, self.lambda_decay_ratio)

    # ---- the block-refiner seam (trainer/methods/dflash/refiner.py) ----------------------------------------------
    def slot_terms(
        self, blocks: torch.Tensor, anchors: torch.Tensor, ids: torch.Tensor, idx: torch.Tensor, prev: torch.Tensor
    ) -> list[SlotTerm]:
        """``(1 - lambda) * final + lambda * base``: the corrected slots' loss and the backbone's own (skipped at
        lambda 0)."""
        lam = self.lambda_base()
        final = SlotTerm(self.correction(blocks, anchors, ids, idx), 1.0 - lam, "final")
        return [final, SlotTerm(None, lam, "base")] if lam > 0 else [final]

    def correction(
        self, blocks: torch.Tensor, anchors: torch.Tensor, ids: torch.Tensor, idx: torch.Tensor
    ) -> LogitBias:
        """The head's logit delta of the trained slots as a low-rank bias: features [n, e] (zero on the slots
        1..pure_draft_prefix_len) and ``embed_proj.2.weight`` [V, e].

        blocks: [B, N, b, H] every slot's normed output; anchors: [B, N]; ids: [B, S]; idx: [n] the trained slots'
        flat indices into [B, N, b - 1] (slot k at k - 1).
        """
        drafter = self.drafter
        B, N, b, _ = blocks.shape
        weight = drafter.embed_proj[2].weight  # [V, e]
        if not idx.numel():
            return LogitBias(weight.new_zeros(0, weight.shape[1]), weight)
        block, slot = idx // (b - 1), idx % (b - 1)  # [n] each; slot = k - 1
        used, block_of = torch.unique(block, return_inverse=True)  # [u], [n]: the blocks with trained slots
        length = int(slot.max()) + 1  # the longest prefix a trained slot reads
        S = ids.shape[1]
        positions = (anchors.flatten()[used][:, None] + torch.arange(length, device=ids.device)).clamp(max=S - 1)
        tokens = ids[(used // N)[:, None], positions]  # [u, T]: the anchor, then the tokens of slots 1..T-1
        states, _ = drafter.prefix_states(F.embedding(tokens, self.embedding_weight()))  # [u, T, G]
        hidden = blocks[:, :, 1:].flatten(0, 2)[idx]  # [n, H]
        corrected = (slot >= drafter.config.pure_draft_prefix_len)[:, None]  # [n, 1]: slot k > p
        features = drafter.features(hidden, states[block_of, slot]) * corrected  # [n, e]
        return LogitBias(features, weight)

    def refiner_loss(
        self, hidden: torch.Tensor, bias: LogitBias | None, accept: torch.Tensor, slot: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """No term of its own (the curriculum is :meth:`slot_terms`); the step's lambda as a metric."""
        return None, {"lambda_base": torch.tensor(self.lambda_base(), device=hidden.device)}
