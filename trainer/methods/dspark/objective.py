"""DSpark: train a DFlash drafter with DSpark's Markov and confidence heads (module.py, heads.py) against a frozen
target; the objective of trainer/methods/dflash/objective.py with its block-refiner hooks (refiner.py there).

The slots' logits gain the Markov bias of the token before each slot's token (teacher forcing: the data's token, as
speculators trains it), through the slot loss's low-rank bias (trainer/methods/dflash/slot_loss.py), which takes the
Markov head's gradients in forward. The confidence head is trained as speculators trains it: binary cross entropy
against the slot's analytical acceptance rate under speculative sampling, ``sum_v min(q_v, p_v) = 1 - TV(q, p)`` of
the slot's (Markov-corrected) draft distribution q and the target's distribution p at temperature 1 (detached), each
slot weighted ``exp(-(k - 1) / gamma)`` and averaged over the trained slots, added to the loss times
``confidence_head_alpha``.

Logged per step besides DFlash's metrics, with the confidence head: ``confidence_loss``, ``confidence_abs_error``,
``confidence_pred_mean`` and ``accept_rate``. The heads are read outside the drafter's forward, so FSDP2 and ZeRO-3
(which shard the drafter's weights outside its forward) are refused by name.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from trainer.interface.errors import RecipeError
from trainer.losses.distribution import DEFAULT_ETA
from trainer.methods.dflash.module import DFlashConfig
from trainer.methods.dflash.objective import DFlash
from trainer.methods.dflash.refiner import LogitBias
from trainer.methods.dspark import kind as dspark_kind
from trainer.methods.dspark.heads import check_heads
from trainer.methods.dspark.module import HEAD_KEYS, DSparkConfig, DSparkDrafter
from trainer.models.block_attention import Impl
from trainer.training.objective import TargetSignals
from trainer.training.optimizers import Optim
from trainer.training.registry import DrafterRecord


class DSpark(DFlash):
    """Trains a DSpark drafter (a DFlash drafter with DSpark's heads) against an online frozen target, or from
    precomputed target shards."""

    drafter_class = DSparkDrafter
    drafter: DSparkDrafter

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
        markov_rank: int = 256,
        markov_head_type: str = "vanilla",
        enable_confidence_head: bool = True,
        confidence_head_with_markov: bool = True,
        confidence_head_alpha: float = 1.0,
        optim: Optim = Optim(),
    ) -> None:
        """The options of DFlash (trainer/methods/dflash/objective.py) and DSpark's heads, whose defaults are
        speculators'.

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
            gamma: slot k's loss weight is exp(-(k - 1) / gamma) with ``position_weights: decay``, and its confidence
                loss's weight; None: 7 at b = 16, 4 at b = 8.
            position_weights: "decay" (the DFlash paper's fixed weights, ``gamma``) or "dpace" (speculators' default for
                DFlash, D-PACE: slot k weighted by the block's expected accepted length's derivative with respect to
                its log-confidence, from the drafter's own losses in the step, slot_loss.block_dpace_weights); "dpace"
                needs token labels ("argmax" or "data").
            dpace_alpha: D-PACE's smoothing of each slot's confidence, ``(1 - a) * exp(-loss) + a``, in (0, 1].
            labels: "argmax" (the default) trains on the target's argmax (cross entropy), what greedy verification
                accepts; "data" on the rows' own tokens, "soft" on the target's distribution (KL).
            loss: each slot's loss toward its label (trainer/losses/distribution.py): "kl" (KL(p || q); the cross
                entropy with token labels), "tv" (1 - alpha, alpha = sum_v min(p_v, q_v) the expected acceptance),
                "nla" (-log alpha; the cross entropy with token labels) or "lk_hybrid" (lambda * KL + (1 - lambda)
                * TV, lambda = exp(-lk_eta * alpha)); with token labels p is the label's one-hot. "dpace" needs "kl".
            lk_eta: the hybrid's temperature eta (3, the LK paper's and speculators' default).
            attention: the block-sparse attention: "flex" (CUDA), "dense", or "auto" (flex on CUDA).
            loss_chunk_size: slots projected to the vocabulary at a time (slot_loss.py).
            init_from: a training checkpoint or export of a DSpark or DFlash drafter to start from (its weights and
                shape; the heads the recipe sets kept when they are its own, else new ones on its backbone).
            target_dtype: the target's weights dtype (float32, bfloat16, float16).
            drafter_dtype: the drafter's weights dtype.
            trust_remote_code: allow custom modelling code in the target directory (off by default).
            seed: seed of the drafter's initialisation and of the anchors.
            target_signals: "online" runs the target in every step; "shards" reads its hidden states of
                ``target_layers`` (and top-k next tokens, for soft labels) from a ShardDataModule, never building it.
            markov_rank: the Markov logit-bias head's rank r (heads.py), slot k biased by the token before its own
                (the draft of slot k - 1 when drafting); 0: none. speculators uses 256, for vocabularies of 150k.
            markov_head_type: the Markov head's variant: "vanilla" (speculators' "gated" and "rnn" are refused).
            enable_confidence_head: the confidence head, predicting each slot's acceptance probability.
            confidence_head_with_markov: the confidence head also reads the previous token's Markov embedding (needs
                both heads).
            confidence_head_alpha: the confidence head's binary cross entropy is added to the loss times this.
            optim: optimizer and learning-rate schedule.
        """
        if confidence_head_alpha < 0:
            raise RecipeError(f"model.confidence_head_alpha={confidence_head_alpha} must be >= 0")
        try:
            check_heads(markov_rank, markov_head_type, enable_confidence_head, confidence_head_with_markov)
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
        self.confidence_alpha = float(confidence_head_alpha)
        decay = torch.exp(-torch.arange(self.drafter.config.block_size - 1, dtype=torch.float32) / self.gamma)
        self.register_buffer("conf_decay", decay, persistent=False)  # the confidence loss's weights, as speculators'

    def drafter_config(self, config: DFlashConfig) -> DSparkConfig:
        """The backbone's ``config`` with the recipe's heads (``model.markov_rank``...: this run's hyper-parameters)."""
        return DSparkConfig(**config.to_dict(), **{key: self.hparams[key] for key in HEAD_KEYS})

    def drafter_record(self) -> DrafterRecord:
        architectures = getattr(self.target.config, "architectures", None) or []
        return dspark_kind.make_record(self.drafter.config, self.target_path, architectures)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.weights_are_sharded():
            raise RecipeError(
                "model.markov_rank / enable_confidence_head: DSpark's heads are read outside the drafter's forward, "
                "which FSDP2 and ZeRO-3 shard; train them with DDP or on one device"
            )
        return super().compute_loss(batch)

    def slot_bias(self, prev: torch.Tensor) -> LogitBias | None:
        """The Markov head's bias: the previous tokens' embeddings [n, r] and ``markov_w2`` [V, r]; None without it."""
        markov = self.drafter.markov_head
        if markov is None:
            return None
        return LogitBias(markov.prev_embeddings(prev), markov.markov_w2.weight)

    def wants_acceptance(self) -> bool:
        """The confidence head's labels are the slots' acceptance rates."""
        return self.drafter.confidence_head is not None

    def refiner_loss(
        self, hidden: torch.Tensor, bias: LogitBias | None, accept: torch.Tensor, slot: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """The confidence head's weighted binary cross entropy times ``confidence_head_alpha``, and its metrics."""
        confidence = self.drafter.confidence(hidden, None if bias is None else bias.features)  # [n] logits, or None
        if confidence is None:
            return None, {}
        bce = F.binary_cross_entropy_with_logits(confidence.float(), accept, reduction="none")  # [n]
        predicted = torch.sigmoid(confidence.detach().float())  # [n]
        confidence_loss = (bce * self.conf_decay.to(hidden.device)[slot]).sum() / slot.numel()
        metrics = {
            "confidence_loss": confidence_loss.detach(),
            "confidence_abs_error": (predicted - accept).abs().mean(),
            "confidence_pred_mean": predicted.mean(),
            "accept_rate": accept.mean(),
        }
        return self.confidence_alpha * confidence_loss, metrics
