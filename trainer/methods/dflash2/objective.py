"""DFlash2: train a DFlash drafter with DFlash2's convolutions and path selector (module.py, conv.py, selector.py)
against a frozen target; the objective of trainer/methods/dflash/objective.py with its block-refiner hooks (refiner.py
there).

The loss is speculators' (``DFlash2DraftModel.forward``, ``models/dflash2/metrics.py``): DFlash's slot loss of the
unary logits (``model.loss``, ``model.labels``, the slot weights) plus ``selector_loss_alpha`` times the selector's
loss, a cross entropy over each trained slot's top-k unary candidates (the weakest replaced by the target's token
when it is missing, selector.py ``training_candidates``) of their rescored logits given the data's token before the
slot's (teacher forcing), toward the target's token: the label token with ``labels: data``, else the target's argmax
(speculators' ``targets.argmax``). The selector's slot weights are the slot loss's (``exp(-(k - 1) / gamma)``
normalised, or D-PACE from the selector's own losses, as speculators'); its gradients reach the slots' outputs through
the candidates' unary logits too, as in speculators. The candidates are found a chunk of ``loss_chunk_size`` slots at
a time (one more vocabulary projection, without gradient), and their logits recomputed in backward a chunk at a time,
so no [n, K, H] tensor is kept.

Logged per step besides DFlash's metrics: ``selector_loss``, ``unary_acc`` (the unary argmax right, DFlash's
``acc``), ``candidate_recall`` (the target's token among the slot's top-k) and ``selector_acc`` (the selector's choice
right given the data's previous token, where the top-k holds the target's token). ``acc_k``, ``prefix_k`` and
``block_tau`` are those of the selector's choices (speculators' ``eal`` follows the selector's greedy path the same
way), what drafting proposes. The selector is read outside the drafter's forward, so FSDP2 and ZeRO-3 are refused by
name.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.interface.errors import RecipeError
from trainer.losses.distribution import DEFAULT_ETA
from trainer.methods.dflash.module import DFlashConfig
from trainer.methods.dflash.objective import DFlash
from trainer.methods.dflash.refiner import LogitBias
from trainer.methods.dflash.slot_loss import Weights
from trainer.methods.dflash2 import kind as dflash2_kind
from trainer.methods.dflash2.module import DFlash2Config, DFlash2Drafter
from trainer.methods.dflash2.selector import training_candidates
from trainer.models.block_attention import Impl
from trainer.training.objective import TargetSignals
from trainer.training.optimizers import Optim
from trainer.training.registry import DrafterRecord

RECIPE_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""DFlash2's drafter fields set by the recipe (``model.<key>``)."""


class DFlash2(DFlash):
    """Trains a DFlash2 drafter (a DFlash drafter with convolutions around its sublayers and a path selector) against
    an online frozen target, or from precomputed target shards."""

    drafter_class = DFlash2Drafter
    drafter: DFlash2Drafter

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
        conv_kernel_size: int = 2,
        conv_group_size: int = 16,
        selector_rank: int = 256,
        selector_top_k: int = 16,
        selector_loss_alpha: float = 1.0,
        optim: Optim = Optim(),
    ) -> None:
        """The options of DFlash (trainer/methods/dflash/objective.py) and DFlash2's, whose defaults are speculators'.

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
            gamma: slot k's loss weight is exp(-(k - 1) / gamma) with ``position_weights: decay`` (the selector's
                loss too); None: 7 at b = 16, 4 at b = 8.
            position_weights: "decay" (the DFlash paper's fixed weights, ``gamma``) or "dpace" (D-PACE: slot k weighted
                by the block's expected accepted length's derivative with respect to its log-confidence, from the
                drafter's own losses in the step; the selector's from its own losses); "dpace" needs token labels.
            dpace_alpha: D-PACE's smoothing of each slot's confidence, ``(1 - a) * exp(-loss) + a``, in (0, 1].
            labels: "argmax" (the default) trains on the target's argmax (cross entropy), what greedy verification
                accepts; "data" on the rows' own tokens, "soft" on the target's distribution (KL). The selector's
                token is the label token with "data", else the target's argmax.
            loss: each slot's unary loss toward its label (trainer/losses/distribution.py): "kl", "tv", "nla" or
                "lk_hybrid"; the selector's loss is a cross entropy over the candidates whatever this is.
            lk_eta: the hybrid's temperature eta (3, the LK paper's and speculators' default).
            attention: the block-sparse attention: "flex" (CUDA), "dense", or "auto" (flex on CUDA).
            loss_chunk_size: slots projected to the vocabulary at a time (slot_loss.py, and the selector's candidates).
            init_from: a training checkpoint or export of a DFlash2 or DFlash drafter (or another refiner's) to start
                from (its weights and shape; convolutions and selector kept when they are its own and of the recipe's
                shape, else new ones: identity convolutions, a new selector).
            target_dtype: the target's weights dtype (float32, bfloat16, float16).
            drafter_dtype: the drafter's weights dtype.
            trust_remote_code: allow custom modelling code in the target directory (off by default).
            seed: seed of the drafter's initialisation and of the anchors.
            target_signals: "online" runs the target in every step; "shards" reads its hidden states of
                ``target_layers`` (and top-k next tokens, for soft labels) from a ShardDataModule, never building it.
            conv_kernel_size: the taps of the dynamic convolutions around each attention and MLP (conv.py); slot k
                reads slots k - taps + 1 .. k of its block; at most ``block_size``.
            conv_group_size: channels sharing one dynamic tap; it divides the target's hidden size.
            selector_rank: the rank r of the selector's bilinear term (selector.py); speculators uses 256, for
                vocabularies of 150k.
            selector_top_k: the candidates per slot the selector rescores (drafts are among them).
            selector_loss_alpha: the selector's cross entropy is added to the loss times this.
            optim: optimizer and learning-rate schedule.
        """
        if selector_loss_alpha < 0:
            raise RecipeError(f"model.selector_loss_alpha={selector_loss_alpha} must be >= 0")
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
        self.selector_alpha = float(selector_loss_alpha)
        self._selector_metrics: dict[str, torch.Tensor] = {}

    def drafter_config(self, config: DFlashConfig) -> DFlash2Config:
        """The backbone's ``config`` with the recipe's convolutions and selector (this run's hyper-parameters); a
        drafter without sliding layers gets DFlash2's ``sliding_window_non_causal`` default, true (inert there)."""
        fields = config.to_dict()
        fields["sliding_window_non_causal"] = config.sliding_window_non_causal or config.all_full
        try:
            return DFlash2Config(**fields, **{key: self.hparams[key] for key in RECIPE_KEYS})
        except ValueError as err:  # a convolution or selector that does not fit the target
            raise RecipeError(f"model.{err}") from err

    def drafter_record(self) -> DrafterRecord:
        architectures = getattr(self.target.config, "architectures", None) or []
        return dflash2_kind.make_record(self.drafter.config, self.target_path, architectures)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.weights_are_sharded():
            raise RecipeError(
                "model.selector_rank: DFlash2's selector is read outside the drafter's forward, which FSDP2 and "
                "ZeRO-3 shard; train it with DDP or on one device"
            )
        self._selector_metrics = {}
        return super().compute_loss(batch)

    def _slot_losses(
        self,
        hidden: torch.Tensor,
        bias: LogitBias | None,
        weights: Weights,
        chunks: int | list[slice],
        ids: torch.Tensor,
        batch: dict[str, torch.Tensor],
        final: torch.Tensor | None,
        rows: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """DFlash's slot loss of the unary logits plus ``selector_loss_alpha`` times the selector's (the module
        docstring); the right flags returned are the selector's choices'. The arguments are DFlash's."""
        loss, hits, accept = super()._slot_losses(hidden, bias, weights, chunks, ids, batch, final, rows, positions)
        if hidden.shape[0] == 0:
            return loss, hits, accept
        head = self.target.lm_head_weight.detach()  # [V, H]
        if self.labels == "data":
            target = ids[rows, positions]  # [n]
        else:
            target = self._target_argmax(final, head, batch, rows, positions - 1)  # [n]
        selector_loss, chosen, present = self.selector_loss(hidden, head, target, ids[rows, positions - 1], weights,
                                                            chunks)  # fmt: skip
        right = chosen.eq(target) & present  # [n]: the selector drafts the target's token
        self._selector_metrics = {
            "selector_loss": selector_loss.detach(),
            "unary_acc": hits.float().mean(),
            "candidate_recall": present.float().mean(),
            "selector_acc": right[present].float().mean() if bool(present.any()) else right.float().sum(),
        }
        return loss + self.selector_alpha * selector_loss, right, accept

    def selector_loss(
        self,
        hidden: torch.Tensor,
        head: torch.Tensor,
        target: torch.Tensor,
        prev: torch.Tensor,
        weights: Weights,
        chunks: int | list[slice],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The selector's weighted cross entropy [] of n trained slots, its choice [n] given ``prev`` and whether the
        unary top-k held the target's token [n] bool.

        hidden: [n, H] the slots' outputs; head: [V, H] the lm_head; target: [n] the target's token of each slot;
        prev: [n] the data's token before it; weights, chunks: the slot loss's (a [n] tensor, or a function of a
        chunk's losses; slots per chunk or the chunks).
        """
        n = hidden.shape[0]
        parts = [slice(i, i + chunks) for i in range(0, n, chunks)] if isinstance(chunks, int) else list(chunks)
        selector = self.drafter.candidate_selector
        with torch.no_grad():  # the unary top-k, one chunk's [C, V] logits at a time
            candidates = torch.cat([selector.candidates(hidden[p].float() @ head.t().float()) for p in parts])
        candidates, position, present = training_candidates(candidates, target)  # [n, K], [n], [n]

        def scores(h: torch.Tensor, c: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
            unary = torch.einsum("nh,nkh->nk", h.float(), head[c].float())  # [C, K] the candidates' unary logits
            return unary + selector.transition(h, before, c).float()  # [C, K]

        score = torch.cat([checkpoint(scores, hidden[p], candidates[p], prev[p], use_reentrant=False) for p in parts])
        ce = F.cross_entropy(score, position, reduction="none")  # [n]
        if callable(weights):
            w = torch.cat([weights(p, ce[p].detach()) for p in parts]).to(ce.dtype)  # [n]
        else:
            w = weights.to(ce.dtype)  # [n]
        chosen = candidates.gather(1, score.detach().argmax(-1, keepdim=True))[:, 0]  # [n]
        return (w * ce).sum(), chosen, present

    def refiner_loss(
        self, hidden: torch.Tensor, bias: LogitBias | None, accept: torch.Tensor, slot: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """No term beyond the selector's (in the slot losses); its metrics."""
        return None, dict(self._selector_metrics)
