"""DFlash: train a block-diffusion drafter (module.py) against a frozen target.

A training row of ``S`` tokens gives up to ``max_anchors`` blocks. Anchors are drawn uniformly without replacement
(deterministically in the seed, the step and the batch) among the positions ``a`` whose token and next token are
both trained (the loss mask allows at the anchor and the next token: at inference an anchor is always a committed
output token), then sorted. Block ``j`` is ``[token a_j, mask x (b - 1)]`` at positions ``a_j .. a_j + b - 1`` and
sees the context (the target's hidden states of the chosen layers, ``hidden_norm(fc(.))``) of positions ``< a_j``
and its own block; all blocks of a batch run in one drafter pass under the anchored block-sparse mask
(trainer/models/block_attention.py: flex attention on CUDA, a mask-aware dense computation elsewhere).

Slot ``k >= 1`` of block ``j`` predicts the token at ``a_j + k`` (slot 0, the anchor, is not trained), where that token
is inside the row and trained. Its weight is ``exp(-(k - 1) / gamma)`` (gamma 7 at b = 16), normalised over the block:
the loss is the weighted mean of the slots' losses, so early slots, whose mistakes end the accepted prefix, count most.
With ``position_weights: dpace`` (D-PACE, speculators' default for DFlash) the weights follow the drafter's own
confidences in the step instead: slot k weighs what it adds to the block's expected accepted length
(slot_loss.dpace_weights), so later slots count as the earlier ones get right; the loss is then the weighted sum
over the trained slots' count. Labels: ``data``, the row's own token (cross entropy; with regenerated data, ``draftsmith
generate``, the target's own output), ``argmax`` (the default), the target's own choice at the position before the
slot's token (cross entropy against the argmax of its distribution, speculators' default "ce" loss; from shards: the
stored top-1), or ``soft``, the target's distribution there, ``KL(p || q)`` (online: the target's full distribution;
from shards: its stored top-k, renormalised over the k ids, which at k = V is the online loss). Logits go through the
target's frozen lm_head, one chunk of ``loss_chunk_size`` slots at a time, their gradients taken in the same pass
(slot_loss.py), so the float32 logits of all slots never exist at once and none is recomputed in backward.

Online mode runs the target's decoder (no logits over the whole batch) in every step for its hidden states. Offline
mode (``target_signals: shards``) reads them from ``draftsmith precompute`` shards holding exactly the drafter's
target layers (``data.hidden_layers`` equal to ``model.target_layers``, in order), with the top-k next tokens for soft
labels; the target model is never built, only its config, embedding and lm_head are read from its safetensors.

The drafter uses the target's embedding and lm_head and trains only its own layers, ``fc`` and the norms. The mask
token is an id the tokenizer does not use (module.py ``check_mask_token``), recorded in the drafter's
config and every export; a special token accepted there is also refused when the training data contains it.

The loss of each slot toward its label is ``model.loss`` (trainer/losses/distribution.py): ``kl`` (the default; the
cross entropy with token labels, KL(p || q) with soft ones), ``tv`` (1 - alpha), ``nla`` (-log alpha) or ``lk_hybrid``
(the LK losses); with token labels ``p`` is the label's one-hot (``nla`` is then the cross entropy, ``tv`` is 1 -
q_label). D-PACE's weights read the token cross entropies, so ``position_weights: dpace`` needs ``kl``.

Logged per step: the loss, ``acc_k`` (slot k's argmax equals its label token, or the target's argmax with soft labels),
``alpha_k`` (slot k's expected acceptance under speculative sampling, ``sum_v min(p_v, q_v)`` against the target's
distribution at temperature 1 online, its stored top-k renormalised from shards, for every loss and label; the mean over
the trained slots; on the steps whose metrics are logged, unless a refiner reads the rates in every step),
``prefix_k`` (slots 1..k of a block all right, over the blocks whose slots 1..k are all trained: the
teacher-forced counterpart of ``draftsmith eval``'s acceptance per draft position, had every position been a round's
root) and ``block_tau`` (1 + the leading slots of a block that are right, over the blocks: the teacher-forced accepted
length of one block); a block refiner adds its own (refiner.py).

A block refiner's objective subclasses this one and overrides the hooks of the seam (refiner.py): the drafter it
builds, its slots' logit bias, whether it reads their acceptance rates, and its loss terms and metrics; DFlash has no
refiner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainer.interface.errors import CheckpointError, RecipeError, UserError
from trainer.losses.distribution import DEFAULT_ETA, DistributionLoss
from trainer.methods.dflash import kind as dflash_kind
from trainer.methods.dflash.module import (
    SLIDING,
    DFlashConfig,
    DFlashDrafter,
    check_mask_token,
    default_gamma,
    default_target_layers,
)
from trainer.methods.dflash.refiner import LogitBias, SlotTerm, backbone_config, refit
from trainer.methods.dflash.slot_loss import ChunkLabels, Weights, block_chunks, block_dpace_weights, slot_loss
from trainer.models.block_attention import Impl
from trainer.models.documents import check_window
from trainer.models.target import FrozenTarget, document_kwargs, resolve_dtype
from trainer.training.activation_memory import (
    F32,
    PlannedStep,
    Shape,
    chunked,
    dense_scores,
    frozen_forward,
    layer_saved,
)
from trainer.training.objective import (
    DataRequirements,
    DraftObjective,
    TargetSignals,
    causal_lm_flops_per_token,
    count_params,
    derived_seed,
)
from trainer.training.optimizers import Optim
from trainer.training.registry import DrafterRecord, check_target, load_drafter


class DFlash(DraftObjective):
    """Trains a DFlash drafter against an online frozen target, or from precomputed target shards."""

    drafter_class: type[DFlashDrafter] = DFlashDrafter
    """The drafter this objective builds (a block refiner's objective names its own, refiner.py)."""
    honours_document_ids = True  # target and blocks see document_ids; a slot past its anchor's document is not trained

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
        window: int | None = None,
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
            init_from: a training checkpoint or export of a DFlash drafter to start from (its weights and shape; a
                block refiner's drafter gives its backbone, refiner.py ``refit``).
            target_dtype: the target's weights dtype (float32, bfloat16, float16).
            drafter_dtype: the drafter's weights dtype.
            trust_remote_code: allow custom modelling code in the target directory (off by default).
            seed: seed of the drafter's initialisation and of the anchors.
            target_signals: "online" runs the target in every step; "shards" reads its hidden states of
                ``target_layers`` (and top-k next tokens, for soft labels) from a ShardDataModule, never building it.
            window: sliding-window draft attention, in tokens: every draft layer becomes a non-causal
                ``sliding_attention`` one whose block anchored at a sees the context a - window .. a - 1 (speculators'
                meaning of its ``sliding_window``), in training and drafting alike; null (the default) sees the whole
                context. Exported as ``layer_types``, ``sliding_window`` and ``sliding_window_non_causal: true`` in the
                speculators format; the z-lab format refuses it. With ``init_from`` it replaces the loaded drafter's.
            optim: optimizer and learning-rate schedule.
        """
        super().__init__(optim)
        self.save_hyperparameters(ignore=["optim"])
        if max_anchors < 1 or loss_chunk_size < 1:
            raise RecipeError(
                f"model.max_anchors and loss_chunk_size must be >= 1, got {max_anchors}, {loss_chunk_size}"
            )
        if block_size < 2:
            raise RecipeError(f"model.block_size={block_size}: a block needs the anchor and at least one mask slot")
        if position_weights == "dpace" and labels == "soft":
            raise RecipeError(
                "model.position_weights: dpace weighs each slot by its probability of a token label: set model.labels "
                "to argmax or data, or position_weights to decay"
            )
        if not 0.0 < dpace_alpha <= 1.0:
            raise RecipeError(f"model.dpace_alpha={dpace_alpha} must be in (0, 1]")
        self.loss_spec = DistributionLoss.from_options(loss, lk_eta)
        if position_weights == "dpace" and not self.loss_spec.is_kl:
            raise RecipeError(
                f"model.position_weights: dpace weighs each slot by its token cross entropy, which model.loss={loss!r} "
                "does not give: set model.loss to kl or position_weights to decay"
            )
        self.position_weights, self.dpace_alpha = position_weights, float(dpace_alpha)
        self.labels, self.attention = labels, attention
        self.max_anchors, self.loss_chunk_size, self.seed = max_anchors, loss_chunk_size, seed
        check_window(window, "model.window")
        frozen = self.load_target(target, target_signals, target_dtype, trust_remote_code)
        torch.manual_seed(seed)
        if init_from is not None:
            start = self.initial_drafter(init_from)
            config = self.drafter_config(backbone_config(start.config))
            self.drafter = refit(start, self.drafter_class, config, init_from)
        else:
            L = frozen.num_layers
            layers = list(target_layers) if target_layers else list(default_target_layers(L, context_layers))
            outside = [i for i in layers if not 1 <= i <= L - 1]
            if outside:
                raise RecipeError(
                    f"model.target_layers={layers}: {outside} outside the layer outputs every engine reads of the "
                    f"{L}-layer target, hidden_states 1..{L - 1} (z-lab ids 0..{L - 2})"
                )
            rows = int(self.embedding_weight().shape[0])
            try:
                mask = check_mask_token(mask_token_id, self.tokenizer, rows)
            except UserError:
                raise
            except ValueError as err:  # the check names model.mask_token_id: a recipe value
                raise RecipeError(str(err)) from err
            config = DFlashConfig.from_target(frozen.config, num_draft_layers, layers, block_size, mask)
            self.drafter = self.drafter_class(self.drafter_config(replace(config, vocab_size=rows)))
        if window is not None:
            c = self.drafter.config
            c.layer_types, c.sliding_window = (SLIDING,) * c.num_hidden_layers, window
            c.sliding_window_non_causal = True
        self.drafter.to(resolve_dtype(drafter_dtype))
        b = self.drafter.config.block_size
        self.gamma = default_gamma(b) if gamma is None else gamma
        if self.gamma <= 0:
            raise RecipeError(f"model.gamma={gamma} must be > 0")
        decay = torch.exp(-torch.arange(b - 1, dtype=torch.float32) / self.gamma)  # slot k = 1..b-1
        self.register_buffer("decay", decay / decay.sum(), persistent=False)  # normalised over the block

    # ---- the block-refiner seam (refiner.py): a refiner's objective overrides these; DFlash has no refiner ----------
    def drafter_config(self, config: DFlashConfig) -> DFlashConfig:
        """The config of the drafter to build (:attr:`drafter_class`) from the backbone's ``config``: DFlash's own."""
        return config

    def initial_drafter(self, init_from: str) -> DFlashDrafter:
        """The drafter of ``model.init_from``: a DFlash drafter (of this target), or a block refiner's, whose backbone
        :func:`~trainer.methods.dflash.refiner.refit` carries over."""
        drafter, record = load_drafter(init_from)
        where = f"model.init_from {init_from!r}"
        if not isinstance(drafter, DFlashDrafter):
            raise CheckpointError(f"{where}: holds a drafter of kind {record.kind!r}, not a DFlash drafter")
        check_target(record, self.target_config, where)
        return drafter

    def slot_bias(self, prev: torch.Tensor) -> LogitBias | None:
        """The low-rank logit bias of the trained slots given the token before each slot's token ``prev`` [n] (the
        data's: teacher forcing), or None: DFlash's logits are the lm_head's alone."""
        return None

    def slot_terms(
        self, blocks: torch.Tensor, anchors: torch.Tensor, ids: torch.Tensor, idx: torch.Tensor, prev: torch.Tensor
    ) -> list[SlotTerm]:
        """The step's slot losses (their sum, scaled, is the step's loss): the first is the main one, whose slots'
        right-argmax flags and acceptance rates are the step's metrics and :meth:`refiner_loss`'s.

        blocks: [B, N, b, H] the normed output of every slot of every block (slot 0, the anchor, included); anchors:
        [B, N] the blocks' anchor positions; ids: [B, S] the rows; idx: [n] the trained slots' flat indices into
        [B, N, b - 1] (slot k at k - 1); prev: [n] the data's token before each trained slot's token. DFlash: one
        term, :meth:`slot_bias` of ``prev``."""
        return [SlotTerm(self.slot_bias(prev))]

    def wants_acceptance(self) -> bool:
        """Whether :meth:`refiner_loss` reads the slots' analytical acceptance rates in every step; otherwise they (and
        the target's distribution they need, with token labels) are taken only on the steps whose metrics are logged
        (:meth:`metrics_due`, the ``alpha_k`` metrics). DFlash: no."""
        return False

    def refiner_loss(
        self, hidden: torch.Tensor, bias: LogitBias | None, accept: torch.Tensor, slot: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """A block refiner's loss term (added to the slot loss) and metrics of the n >= 1 trained slots: their outputs
        ``hidden`` [n, H], their :meth:`slot_bias`, acceptance rates ``accept`` [n] against the target's distribution
        and index ``slot`` [n] (k - 1 for slot k). DFlash: none."""
        return None, {}

    def drafter_record(self) -> DrafterRecord:
        """The drafter's record (kind ``dflash``; a block refiner's objective names its own kind)."""
        architectures = getattr(self.target.config, "architectures", None) or []
        return dflash_kind.make_record(self.drafter.config, self.target_path, architectures)

    def trainable_module(self) -> nn.Module:
        return self.drafter

    def embedding_weight(self) -> torch.Tensor:
        """The target's input embedding [V, H]."""
        t = self.target
        return t.model.get_input_embeddings().weight if isinstance(t, FrozenTarget) else t.embedding

    # ---- data checks ---------------------------------------------------------------------------------------------
    def data_requirements(self) -> DataRequirements:
        """The target's tokenizer; shards of this target and tokenizer, holding the drafter's target layers in its
        order, at temperature 1 for soft labels (the target's own distribution)."""
        config = self.drafter.config
        return DataRequirements(
            self.target.vocab_size, temperature=1.0 if self.labels == "soft" else None,
            target_layers=config.target_layers, hidden_size=config.hidden_size,
        )  # fmt: skip

    def setup(self, stage: str) -> None:
        self.check_training_data(self.attached_datamodule())

    def check_training_data(self, datamodule) -> None:
        """Refuses data that does not meet :meth:`data_requirements` and training data holding the mask token."""
        self.check_data(datamodule, self.data_requirements())
        if self.target_signals == "shards":
            rows = datamodule.training_rows()
        else:
            dataset = getattr(datamodule, "train_dataset", None)
            rows = [] if dataset is None or not hasattr(dataset, "ids") else [(dataset.ids, None)]
        mask = self.drafter.config.mask_token_id
        if self.tokenizer is not None and mask < len(self.tokenizer):  # a special token: the data must not hold it
            count = sum(int(np.count_nonzero(np.asarray(ids) == mask)) for ids, _ in rows)
            if count:
                token = self.tokenizer.convert_ids_to_tokens(mask)
                raise RecipeError(
                    f"model.mask_token_id={mask} ({token!r}) occurs {count} times in the training data: the tokenizer "
                    "uses it there; pick an id the data never contains"
                )

    # ---- training ------------------------------------------------------------------------------------------------
    def anchors(self, trained: torch.Tensor, stage: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Block anchors of a batch: ([B, N] positions sorted per row, [B, N] bool real (not padding)).

        trained: [B, S] bool, token t is a trained label. Anchor a needs trained[a] and trained[a + 1].
        """
        B, S = trained.shape
        valid = torch.zeros_like(trained)
        valid[:, :-1] = trained[:, :-1] & trained[:, 1:]  # [B, S]
        counts = valid.sum(1)  # [B]
        N = max(1, min(self.max_anchors, int(counts.max())))
        rank = 0 if self._trainer is None else int(self.trainer.global_rank)
        step = 0 if self._trainer is None else int(self.global_step)
        generator = torch.Generator().manual_seed(derived_seed(self.seed, stage, step, rank, S, int(counts.sum())))
        keys = torch.rand(B, S, generator=generator).to(trained.device)  # [B, S]
        keys = keys.masked_fill(~valid, 2.0)  # invalid positions sort last
        anchors = keys.argsort(dim=1)[:, :N].sort(dim=1).values  # [B, N]
        keep = torch.arange(N, device=trained.device)[None] < counts[:, None].clamp(max=N)  # [B, N]
        # rows with fewer anchors: their padding sorted last, already in place after the sort; zeroed to stay in range
        return torch.where(keep, anchors, 0), keep

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()  # [B, S] each
        # [B, S] packed rows with document masking, else absent (shard batches never carry it: precompute refuses
        # data.document_masking, and target_signals: shards takes a ShardDataModule only)
        documents = batch.get("document_ids")
        target = self.target
        stage = "train" if self.training else "val"
        drafter, b = self.drafter, self.drafter.config.block_size
        B, S = ids.shape
        trained = F.pad(loss_mask[:, :-1], (1, 0), value=False)  # [B, S]: token t is a trained label
        anchors, keep = self.anchors(trained, stage)  # [B, N]
        N = anchors.shape[1]
        if self.target_signals == "shards":
            stored = batch["teacher_hidden"]  # [B, m, S, H], in target_layers order
            hidden = [stored[:, j] for j in range(stored.shape[1])]
            final = None
        else:
            with torch.no_grad():
                decoder = target.model.get_decoder()
                out = decoder(
                    input_ids=ids, output_hidden_states=True, use_cache=False, **document_kwargs(decoder, documents)
                )
            hidden = [out.hidden_states[i] for i in drafter.config.target_layers]  # each [B, S, H]
            final = out.last_hidden_state  # [B, S, H] normed: the target's logits are lm_head(final)
        embeds = F.embedding(drafter.block_ids(ids.gather(1, anchors)), self.embedding_weight())  # [B, N * b, H]
        blocks = drafter(hidden, embeds, anchors, self.attention, documents).view(B, N, b, -1)  # [B, N, b, H]
        slots = blocks[:, :, 1:]  # [B, N, b - 1, H]

        positions = anchors[:, :, None] + torch.arange(1, b, device=ids.device)  # [B, N, b - 1]: token of slot k
        inside = positions < S
        safe = positions.clamp(max=S - 1)
        rows = torch.arange(B, device=ids.device)[:, None, None].expand_as(positions)
        selected = keep[:, :, None] & inside & trained[rows, safe]  # [B, N, b - 1]
        if documents is not None:  # a slot whose token lies in another document than its anchor is not trained
            selected = selected & (documents[rows, safe] == documents.gather(1, anchors)[:, :, None])
        idx = selected.flatten().nonzero()[:, 0]  # [n]
        flat_rows, flat_pos = rows.flatten()[idx], safe.flatten()[idx]  # [n] each
        if self.position_weights == "dpace":  # weights from each block's losses, per chunk of whole blocks
            block, slot = idx // (b - 1), idx % (b - 1)  # [n] each
            chunks = block_chunks(block, self.loss_chunk_size)
            scale = 1.0 / max(idx.numel(), 1)  # the weighted sum over the trained slots' count, as speculators'

            def w(part: slice, losses: torch.Tensor) -> torch.Tensor:
                return block_dpace_weights(losses, block[part], slot[part], self.dpace_alpha) * scale  # [C]

        else:
            chunks = self.loss_chunk_size
            w = self.decay.to(ids.device)[None, None, :].expand_as(positions).flatten()[idx]  # [n]
            w = w / w.sum().clamp(min=torch.finfo(w.dtype).tiny)  # the loss is the weighted mean of the slots' losses
        hidden = slots.flatten(0, 2)[idx]  # [n, H]
        prev = ids[flat_rows, flat_pos - 1]  # [n] the token before each slot's token
        terms = self.slot_terms(blocks, anchors, ids, idx, prev)
        bias = terms[0].bias
        loss, hits, accept = self._slot_losses(hidden, bias, w, chunks, ids, batch, final, flat_rows, flat_pos)
        metrics: dict[str, torch.Tensor] = {}
        if len(terms) > 1 or terms[0].scale != 1.0 or terms[0].name:  # a block refiner's terms (slot_terms)
            mean = torch.full_like(hidden[:, 0], 1.0 / max(idx.numel(), 1), dtype=torch.float32)  # [n]
            parts = [loss]
            for term in terms[1:]:
                part = self._slot_losses(
                    hidden, term.bias, mean if term.uniform else w, chunks, ids, batch, final, flat_rows, flat_pos
                )[0]
                parts.append(part)
            loss = sum(term.scale * part for term, part in zip(terms, parts))
            metrics.update({f"loss_{term.name}": part.detach() for term, part in zip(terms, parts) if term.name})
        if idx.numel():
            slot_of = torch.arange(b - 1, device=ids.device).expand(B, N, b - 1).flatten()[idx]  # [n]: k - 1
            extra, refined = self.refiner_loss(hidden, bias, accept, slot_of)
            metrics.update(refined)
            if extra is not None:
                loss = loss + extra
        with torch.no_grad():
            right = torch.zeros(B * N * (b - 1), dtype=torch.bool, device=ids.device)
            right[idx] = hits
            right = right.view(B, N, b - 1)
            counts = selected.sum((0, 1)).clamp(min=1)  # [b - 1]
            metrics.update({f"acc_{k + 1}": right[:, :, k].sum() / counts[k] for k in range(b - 1)})
            if accept.numel() == idx.numel():  # taken this step (_labels)
                alpha = torch.zeros(B * N * (b - 1), dtype=torch.float32, device=ids.device)
                alpha[idx] = accept.float()
                alpha = alpha.view(B, N, b - 1)  # [B, N, b - 1] the expected acceptance of each trained slot
                metrics.update({f"alpha_{k + 1}": alpha[:, :, k].sum() / counts[k] for k in range(b - 1)})
            prefix = right.long().cumprod(-1)  # [B, N, b - 1]: slots 1..k all right
            full = keep[:, :, None] & selected.long().cumprod(-1).bool()  # [B, N, b - 1]: slots 1..k all trained
            metrics.update(
                {f"prefix_{k + 1}": (prefix[:, :, k] * full[:, :, k]).sum() / full[:, :, k].sum().clamp(min=1)
                 for k in range(b - 1)}
            )  # fmt: skip
            leading = prefix.sum(-1).float() + 1.0  # [B, N]
            metrics["block_tau"] = (leading * keep).sum() / keep.sum().clamp(min=1)
        return loss, metrics

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
        """The weighted loss [] of the selected slots (``model.loss``), their right-argmax flags [n] and their
        analytical acceptance rates [n] against the target's distribution (the ``alpha_k`` metrics).

        hidden: [n, H] the slots' outputs; bias: their logit bias (:meth:`slot_bias`) or None; weights: [n] their
        weights in the loss, or a function of a chunk's losses (slot_loss.py); chunks: slots per chunk or the chunks;
        rows, positions: [n] the batch row and position of each slot's token. Soft and argmax labels come from the
        target's distribution at ``position - 1`` (online: from ``final`` [B, S, H]; shards: the batch's top-k),
        ``data`` labels are the token itself; the acceptance rates are against that distribution (a softmax per chunk
        with token labels too, taken only when :meth:`_labels` wants them: empty [0] otherwise). Argmax labels are
        taken once per position (slots of overlapping blocks share them); the vocabulary projections run one chunk of
        slots at a time, their gradients taken in the same pass (slot_loss.py).
        """
        head = self.target.lm_head_weight.detach()  # [V, H]
        labels = self._labels(ids, batch, final, rows, positions)
        features, weight = (None, None) if bias is None else (bias.features, bias.weight)
        loss, _, hits, accept = slot_loss(hidden, head, weights, labels, chunks, features, weight, self.loss_spec)
        return loss, hits, accept

    def _labels(
        self,
        ids: torch.Tensor,
        batch: dict[str, torch.Tensor],
        final: torch.Tensor | None,
        rows: torch.Tensor,
        positions: torch.Tensor,
    ) -> Callable[[slice], ChunkLabels]:
        """The labels of the trained slots at batch rows ``rows`` [n] and positions ``positions`` [n]: ``labels(part)``
        of the slots ``part`` of the n (:meth:`_slot_losses`), the argmax labels taken once for the step."""
        head = self.target.lm_head_weight.detach()  # [V, H]
        if self.labels == "argmax":
            tokens = self._target_argmax(final, head, batch, rows, positions - 1)  # [n]
        else:
            tokens = ids[rows, positions] if self.labels == "data" else None  # [n], or None: soft labels
        # the target's distribution: for soft labels, a refiner that reads the acceptance rates, and the alpha_k
        # metrics on the steps whose metrics are logged
        want = tokens is None or self.wants_acceptance() or self.metrics_due()

        def labels(part: slice) -> ChunkLabels:
            chunk = ChunkLabels(ids=None if tokens is None else tokens[part], want_accept=want)
            if not want:  # the token labels alone
                return chunk
            if final is not None:  # online: the target's whole distribution at temperature 1
                teacher = final[rows[part], positions[part] - 1]  # [C, H] the target's normed hidden states
                chunk.probs = torch.softmax(self._target_logits(teacher, head), dim=-1)  # [C, V]
            else:  # shards: the stored top-k, renormalised over the k ids
                before = (rows[part], positions[part] - 1)
                probs = torch.softmax(batch["teacher_topk_logprobs"][before].float(), dim=-1)  # [C, k]
                chunk.sparse = (batch["teacher_topk_ids"][before].long(), probs)
            return chunk

        return labels

    @torch.no_grad()
    def _target_argmax(
        self, final: torch.Tensor | None, head: torch.Tensor, batch: dict, rows: torch.Tensor, before: torch.Tensor
    ) -> torch.Tensor:
        """The target's most likely token [n] after positions ``before`` [n] of batch rows ``rows`` [n]. Online: of
        its normed hidden states ``final`` [B, S, H] through the bare head (the output scaling keeps the argmax),
        once per distinct position (overlapping blocks share them), ``loss_chunk_size`` at a time; shards: the stored
        top-1."""
        if final is None:
            return batch["teacher_topk_ids"][rows, before, 0].long()  # [n]
        where, slot_of = torch.unique(rows * final.shape[1] + before, return_inverse=True)  # [u], [n]
        states = final.flatten(0, 1)[where]  # [u, H]
        top = [(part @ head.t().to(part.dtype)).max(-1).indices for part in states.split(self.loss_chunk_size)]
        return torch.cat(top)[slot_of]  # [n]

    def _target_logits(self, final: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """The target's own logits [C, V] float32 of its final normed hidden states ``final`` [C, H] (head: [V, H]):
        with the output scaling its forward applies after the lm_head (Gemma-2's soft-cap, Granite's and Cohere's
        scales). The drafter's own logits go through the bare head, as its proposer computes them."""
        return self.target.logit_scaling((final @ head.t().to(final.dtype)).float())  # [C, V]

    def activation_bytes(self, step: PlannedStep) -> int:
        """The target phase (every hidden state HF returns; from shards the batch's target layers) against the
        draft layers over the sampled blocks' slots, attending to the target's fused context, and the slots' logits
        through the target's lm_head in chunks whose gradients are taken in forward (a float32 [slots, H] gradient
        kept for backward; a loss other than ``kl`` takes its chunk's gradient by autograd, two more [C, V] float32
        tensors alive). Unfused (``attention: dense``, or ``auto`` off CUDA) every layer also keeps its slots' scores
        over the context and their block (:func:`dense_scores`), one layer's backward gradients of them in flight."""
        n, a, a_t = step.tokens, step.element, step.target_element
        config = self.drafter.config
        t = Shape.of(self.target_config)
        m = len(config.target_layers)
        slots = step.batch * min(self.max_anchors, step.seq) * config.block_size
        d = Shape(t.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                  config.num_attention_heads, config.num_key_value_heads, config.head_dim)  # fmt: skip
        if step.shards:
            target_phase = m * n * t.hidden_size * 2
        else:
            target_phase = frozen_forward(t, n, a_t, hidden_kept=t.num_hidden_layers + 1, scores=step.target_scores)
        context = n * (m * t.hidden_size + t.hidden_size) * a_t + n * (m + 1) * t.hidden_size * a  # kept, fused
        layers = config.num_hidden_layers * (layer_saved(d, slots, a) + n * 2 * d.kv_width * a)
        if not step.fused(self.attention):  # the dense path's [B, nh, N * b, S + b] scores in every layer
            shape = (step.batch, d.num_attention_heads, slots // step.batch, step.seq + config.block_size)
            saved = dense_scores(*shape, a)
            layers += config.num_hidden_layers * saved + dense_scores(*shape, a, live=True) - saved
        grad = slots * d.hidden_size * F32  # the slot loss's gradient of the slots' outputs
        copies = 3 if self.loss_spec.is_kl else 5  # autograd on the chunk: its log-softmax, q, min(q, p) and grad
        return max(target_phase, context + layers + grad + chunked(step.chunk, slots, t.vocab_size, copies))

    def flops_per_token(self) -> float:
        S = self.data_seq_len()
        c = self.drafter.config
        slots_per_token = min(self.max_anchors, max(1, S - 1)) * c.block_size / max(1, S)
        head = 2.0 * c.hidden_size * c.vocab_size * (c.block_size - 1) / c.block_size
        drafter = 3.0 * (2.0 * count_params(self.drafter) + head) * slots_per_token
        if self.target_signals == "shards":
            return drafter
        return drafter + causal_lm_flops_per_token(self.target.model, S)
