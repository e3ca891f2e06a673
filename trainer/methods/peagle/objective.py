"""P-EAGLE: train the EAGLE-3 drafter to draft K tokens in one forward (module.py), with COD sampling.

Online: the frozen target runs in the training step and gives its logits and the hidden states of the drafter's aux
layers. Row elements ``a = 0..S-2`` are EAGLE-3's depth-0 elements (features of token ``a``, embedding of token
``a + 1``); for depths ``d = 1..K-1`` COD sampling (conditional drop, speculators 0.9 ``generate_cod_sample_indices``)
keeps a random subset of the anchors of depth ``d - 1`` whose label is trained, about ``max(r ** d, floor)`` of the
row's trained positions, so that every kept placeholder has its whole rollout before it (as at drafting time) and the
sequence grows by ``1 + r + r^2 + ...`` instead of K. Element (a, d) is trained on the target's distribution over the
draft vocabulary at position ``a + 1 + d`` (the token ``a + 2 + d``), soft labels renormalised over the draft
vocabulary, under that position's loss mask; the loss is ``sum_d step_decay ** d * mean_d`` (per-depth means).
``model.loss`` picks the per-element loss as EAGLE-3's does (``kl``, the cross entropy, by default; ``tv``, ``nla`` and
``lk_hybrid`` toward the target's own probabilities over the draft vocabulary, not renormalised), and ``alpha_d`` logs
depth d's expected acceptance ``sum_v min(p_v, q_v)`` against them, averaged over its trained elements (eagle3/
objective.py).

The drafter trains its own input embedding (initialised from the target's) and the placeholders ``mask_hidden`` and
the embedding row of ``mask_token_id``, as speculators' P-EAGLE does. The objective extends EAGLE-3's
(trainer/methods/eagle3/objective.py) and inherits what the two do alike: ``init_from`` and the options it must agree
with, the draft vocabulary and target-layer checks, and the vocabulary map counted from the training rows in ``setup``
(or taken from ``init_from``).

Attention: ``dense`` applies the mask (module.peagle_mask) through SDPA with a boolean mask over the sampled
elements of each row (padded to the longest row); ``flex`` (or ``auto`` on CUDA) runs the same mask through flex
attention. Only online target signals are supported.
"""

from __future__ import annotations

from typing import Literal

import torch

from trainer.interface.errors import RecipeError
from trainer.losses.distribution import DEFAULT_ETA, acceptance, loss_rows
from trainer.methods.eagle3.labels import check_argmax_weight, check_loss, mix_argmax
from trainer.methods.eagle3.objective import Eagle3
from trainer.methods.eagle3.vocab_map import online_target_signals
from trainer.methods.peagle import kind as peagle_kind
from trainer.methods.peagle.module import PEagleConfig, PEagleDrafter
from trainer.models.block_attention import Impl
from trainer.models.documents import check_window
from trainer.models.target import resolve_dtype
from trainer.training.activation_memory import F32, PlannedStep, Shape, layer_saved
from trainer.training.objective import causal_lm_flops_per_token, count_params
from trainer.training.optimizers import Optim
from trainer.training.registry import DrafterRecord


def cod_sample(
    trained: torch.Tensor,
    depths: int,
    ratio: float,
    floor: float,
    generator: torch.Generator | None = None,
    max_anchors: int | None = None,
    documents: torch.Tensor | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """COD sampling of one row: ``trained`` [n + 1] bool, the loss mask of label positions 1..n+1 of the n elements
    (``trained[a + d]``: element (a, d) has a trained label). Returns per depth d = 0.. (anchors [m_d], depth d): depth
    0 every anchor 0..n-1; depth d a random subset of depth d - 1's anchors with ``a + d <= n - 1`` and a trained label,
    of size ``int(n_trained * max(ratio ** d, floor))`` (all of them when fewer), n_trained the anchors with a trained
    depth-0 label. With ``max_anchors`` below n_trained, depth 1 draws from ``max_anchors`` of those, drawn at random,
    and they are n_trained (speculators' ``max_anchors``: the deeper depths' budget, whatever the row's length).
    ``documents`` [n + 2]: the row's document_ids (trainer/models/documents.py); a label position ``a + 1 + d`` in
    another document than anchor ``a`` counts as untrained (None: one document)."""
    n = trained.numel() - 1
    anchors = torch.arange(n, device=trained.device)
    out = [(anchors, 0)]

    def labelled(a: torch.Tensor, d: int) -> torch.Tensor:
        """[m] bool: element (a, d) has a trained label in its anchor's document."""
        ok = trained[(a + d).clamp(max=n)]
        if documents is not None:
            ok = ok & (documents[(a + 1 + d).clamp(max=n + 1)] == documents[a])
        return ok

    first = labelled(anchors, 0)  # [n]
    base = int(first.sum())
    if max_anchors is not None and base > max_anchors:
        seeds = anchors[first]
        pick = torch.randperm(base, generator=generator, device="cpu")[:max_anchors].to(seeds.device)
        anchors, base = seeds[pick.sort().values], max_anchors
    for d in range(1, depths):
        keep = anchors[(anchors + d <= n - 1) & labelled(anchors, d)]
        size = int(base * max(ratio**d, floor))
        if size <= 0 or keep.numel() == 0:
            break
        if keep.numel() > size:
            pick = torch.randperm(keep.numel(), generator=generator, device="cpu")[:size].to(keep.device)
            keep = keep[pick.sort().values]
        anchors = keep
        out.append((anchors, d))
    return [(a, torch.full_like(a, d)) for a, d in out]


class PEagle(Eagle3):
    """Trains a P-EAGLE drafter (EAGLE-3 drafting K tokens in one forward) against an online frozen target."""

    drafter_kind = peagle_kind.KIND
    method_name = "P-EAGLE"

    def __init__(
        self,
        target: str,
        num_depths: int = 4,
        cod_ratio: float = 0.7,
        cod_min_ratio: float = 0.2,
        max_anchors: int | None = None,
        mask_token_id: int | None = None,
        draft_vocab_size: int = 32000,
        target_layers: list[int] | None = None,
        num_layers: int = 1,
        step_decay: float = 1.0,
        loss_mean: Literal["element", "depth"] = "element",
        argmax_weight: float = 0.0,
        loss: Literal["kl", "tv", "nla", "lk_hybrid"] = "kl",
        lk_eta: float = DEFAULT_ETA,
        init_from: str | None = None,
        target_dtype: str = "float32",
        drafter_dtype: str = "float32",
        trust_remote_code: bool = False,
        seed: int = 0,
        attention: Impl = "dense",
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
        fc_norm: bool = False,
        window: int | None = None,
        optim: Optim = Optim(),
    ) -> None:
        """
        Args:
            target: the target, an HF causal LM directory or hub id.
            num_depths: K, the tokens drafted in one forward (depths 0..K-1; speculators' ``num_depths``).
            cod_ratio: r in (0, 1], COD sampling: depth d keeps about ``max(r ** d, cod_min_ratio)`` of the trained
                positions (1 keeps every one: full parallel training).
            cod_min_ratio: the floor of the kept share of every depth, in [0, 1].
            max_anchors: the most anchors of a row whose deeper depths are sampled (a random subset of its trained
                positions, drawn anew each step; COD's ratios then apply to them); None samples from every trained
                position. speculators' ``max_anchors`` (512 per packed sequence by default).
            mask_token_id: the placeholder token id, one the target's tokenizer never produces; None takes the first
                id past the tokenizer (an embedding row the target's padded vocabulary never uses), refused when there
                is none.
            draft_vocab_size: size of the reduced draft vocabulary (the most frequent trained tokens).
            target_layers: the target layers fused by the drafter, in HF hidden_states indices; None uses 2, L // 2,
                L - 3.
            num_layers: the drafter's decoder layers: EAGLE-3's first (over the embedding and the fused features)
                and ``num_layers - 1`` plain Llama layers after it, all under the cross-depth mask (speculators'
                ``num_layers``; the paper's released drafters have 4).
            step_decay: the loss weight of depth d is step_decay ** d.
            loss_mean: "element", one mean over every trained element (deeper depths, sampled less, count less:
                speculators' reduction); "depth", the sum of the per-depth means (every depth counted alike).
            argmax_weight: the weight w of a cross entropy on the target's most likely token of the draft vocabulary
                mixed into each element's soft-label loss, ``(1 - w) * soft + w * CE(argmax)``, in [0, 1] (as
                EAGLE-3's: the argmax is what greedy verification accepts). Only with ``loss: kl``.
            loss: each element's loss, as EAGLE-3's (trainer/losses/distribution.py): "kl" (the cross entropy), "tv"
                (1 - alpha, alpha = sum_v min(p_v, q_v) the expected acceptance against the target's probabilities over
                the draft vocabulary, not renormalised), "nla" (-log alpha) or "lk_hybrid" (lambda * KL + (1 - lambda)
                * TV, lambda = exp(-lk_eta * alpha)).
            lk_eta: the hybrid's temperature eta (3, the LK paper's and speculators' default).
            init_from: a training checkpoint or export of a P-EAGLE drafter to start from (weights, shape, vocabulary
                map and placeholder token).
            target_dtype: the target's weights dtype.
            drafter_dtype: the drafter's weights dtype.
            trust_remote_code: allow custom modelling code in the target directory.
            seed: seed for the drafter's initialisation and the COD sampling.
            attention: "dense" (mask-aware SDPA), "flex" (flex attention, CUDA for training) or "auto".
            norm_before_residual: as EAGLE-3's (the layer's residual is its normed input features).
            norm_before_fc: as EAGLE-3's (one RMSNorm over the concatenated target states); exclusive with fc_norm.
            fc_norm: as EAGLE-3's (one RMSNorm per target state, EAGLE-3.1).
            window: as EAGLE-3's: sliding-window draft attention in tokens (element (a, d) sits at position a + d and
                sees keys at a + d - window + 1 .. a + d), in training and drafting alike; null attends to every
                earlier key. Written to the speculators export's layer config (``sliding_window``, ``layer_types``).
            optim: optimizer and learning-rate schedule.
        """
        # the objective base's: EAGLE-3's constructor takes the TTT options, which P-EAGLE has none of
        super(Eagle3, self).__init__(optim)
        self.save_hyperparameters(ignore=["optim"])
        if num_depths < 1:
            raise RecipeError(f"model.num_depths must be >= 1, got {num_depths}")
        if not 0.0 < cod_ratio <= 1.0:
            raise RecipeError(f"model.cod_ratio must be in (0, 1], got {cod_ratio}")
        self.argmax_weight = check_argmax_weight(argmax_weight)
        self.loss_spec = check_loss(loss, lk_eta, argmax_weight)
        if not 0.0 <= cod_min_ratio <= 1.0:
            raise RecipeError(f"model.cod_min_ratio must be in [0, 1], got {cod_min_ratio}")
        if max_anchors is not None and max_anchors < 1:
            raise RecipeError(f"model.max_anchors must be >= 1 (or null: every trained position), got {max_anchors}")
        if not 0.0 < step_decay <= 1.0:
            raise RecipeError(f"model.step_decay must be in (0, 1], got {step_decay}")
        flags = self.norm_flags(
            norm_before_residual=norm_before_residual, norm_before_fc=norm_before_fc, fc_norm=fc_norm
        )
        if num_layers < 1:
            raise RecipeError(f"model.num_layers must be >= 1, got {num_layers}")
        self.num_depths, self.cod_ratio, self.cod_min_ratio = num_depths, cod_ratio, cod_min_ratio
        self.max_anchors = max_anchors
        self.step_decay, self.loss_mean, self.attention = step_decay, loss_mean, attention
        check_window(window, "model.window")
        frozen = self.load_target(target, "online", target_dtype, trust_remote_code)
        torch.manual_seed(seed)
        self.sampler = torch.Generator().manual_seed(seed)
        self.vocab_fixed = init_from is not None
        if init_from is not None:
            self.drafter = self.drafter_from_init(init_from, flags | {"num_layers": num_layers})
        else:
            mask_id = self._mask_token_id(mask_token_id, frozen.vocab_size)
            base = self.new_config(frozen, target, draft_vocab_size, target_layers, flags)
            self.drafter = PEagleDrafter(PEagleConfig(**base.to_dict(), mask_token_id=mask_id, num_layers=num_layers))
            with torch.no_grad():
                self.drafter.embed_tokens.weight.copy_(frozen.model.get_input_embeddings().weight.float())
        self.drafter.config.window = window
        self.drafter.to(resolve_dtype(drafter_dtype))

    def _mask_token_id(self, asked: int | None, vocab_size: int) -> int:
        """The placeholder id: ``asked``, checked, or the first embedding row past the tokenizer."""
        used = len(self.tokenizer) if self.tokenizer is not None else vocab_size
        if asked is not None:
            if not 0 <= asked < vocab_size:
                raise RecipeError(f"model.mask_token_id {asked} is not a token id of the target (0..{vocab_size - 1})")
            return asked
        if used < vocab_size:
            return used
        raise RecipeError(
            f"model.mask_token_id: the target's tokenizer uses every id of its {vocab_size}-token vocabulary, so no "
            "unused id can serve as P-EAGLE's placeholder",
            hint="set model.mask_token_id to a token id the data never contains (a reserved or unused special "
            "token of the tokenizer)",
        )

    def sample(
        self, loss_mask: torch.Tensor, documents: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """COD elements of every row, padded: anchor, depth [B, N] long and valid [B, N] bool (loss_mask [B, S];
        documents [B, S] the rows' document_ids or None)."""
        rows = []
        for b in range(loss_mask.shape[0]):
            row_documents = None if documents is None else documents[b].cpu()
            parts = cod_sample(loss_mask[b, 1:].cpu(), self.num_depths, self.cod_ratio, self.cod_min_ratio,
                               self.sampler, self.max_anchors, row_documents)  # fmt: skip
            rows.append((torch.cat([a for a, _ in parts]), torch.cat([d for _, d in parts])))
        N = max(a.numel() for a, _ in rows)
        anchor = torch.zeros(len(rows), N, dtype=torch.long)
        depth = torch.zeros(len(rows), N, dtype=torch.long)
        valid = torch.zeros(len(rows), N, dtype=torch.bool)
        for b, (a, d) in enumerate(rows):
            anchor[b, : a.numel()], depth[b, : a.numel()], valid[b, : a.numel()] = a, d, True
        device = loss_mask.device
        return anchor.to(device), depth.to(device), valid.to(device)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]  # [B, S] each
        documents = batch.get("document_ids")  # [B, S] packed rows with document masking, else absent
        drafter = self.drafter
        with_mass = not self.loss_spec.is_kl or self.metrics_due()  # alpha_d is logged only every N steps
        hidden, argmax, probs, mass = online_target_signals(
            self.target, ids, drafter, True, with_mass, documents
        )  # probs: [B, S, Vd]
        aux = torch.cat([h[:, :-1] for h in hidden], dim=-1)  # [B, S - 1, n Ht]
        anchor, depth, valid = self.sample(loss_mask, documents)  # [B, N] each
        return self.parallel_loss(ids, loss_mask, aux, probs, argmax, anchor, depth, valid, mass, documents)

    def parallel_loss(self, ids, loss_mask, aux, probs, target_argmax, anchor, depth, valid, mass=None, documents=None):
        """The loss of sampled elements. ids, loss_mask, target_argmax: [B, S]; aux: [B, S - 1, n Ht] the concatenated
        target states; probs: [B, S, Vd] soft labels (renormalised over the draft vocabulary); anchor, depth, valid: [B,
        N]; mass: [B, S] the target's probability of the draft vocabulary (``probs * mass`` its own probabilities, what
        ``alpha_d`` and the losses other than ``kl`` are measured against); None: the losses take it as 1 and
        ``alpha_d`` is not computed (``kl`` on a step whose metrics are not logged); documents: [B, S] the rows'
        document_ids (trainer/models/documents.py) or None: elements attend within their anchor's document and an
        element whose label position is in another document is not trained."""
        drafter = self.drafter
        B, N = anchor.shape
        n = ids.shape[1] - 2  # the depth-0 elements: anchors 0..S-3 in order (COD sampling's), placeholders after
        real = aux[:, :n].to(drafter.mask_hidden.dtype)  # [B, n, n Ht]
        hidden = drafter.fuse(list(real.split(drafter.config.target_hidden_size, dim=-1)))  # [B, n, H]
        embeds = drafter.embed_tokens(ids[:, 1 : n + 1]).to(hidden.dtype)  # [B, n, H]: token a + 1 of anchor a
        logits = drafter.parallel(embeds, hidden, anchor, depth, valid, self.attention, documents)  # [B, N, Vd]
        label = (anchor + 1 + depth).clamp(max=ids.shape[1] - 1)  # [B, N] label positions
        mask = valid & loss_mask.gather(1, label).bool()  # [B, N]
        if documents is not None:  # the label position in the anchor's own document
            mask = mask & (documents.gather(1, label) == documents.gather(1, anchor))
        where = label[..., None].expand(B, N, probs.shape[-1])  # [B, N, Vd]
        own = probs.gather(1, where)  # [B, N, Vd] the target's probabilities, renormalised
        if mass is not None:
            own = own * mass.gather(1, label)[..., None]  # not renormalised
        if self.loss_spec.is_kl:
            labels = mix_argmax(probs, self.argmax_weight).gather(1, where)  # [B, N, Vd]
            per = -(labels * torch.log_softmax(logits.float(), dim=-1)).sum(-1)  # [B, N]
        else:
            per = loss_rows(logits, own, self.loss_spec, want_kl=False)[0]  # [B, N]
        weight = self.step_decay ** depth.float()  # [B, N]
        metrics: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            hits = drafter.to_target_ids(logits.argmax(-1)) == target_argmax.gather(1, label)  # [B, N]
            alpha = None if mass is None else acceptance(torch.softmax(logits.float(), dim=-1), own)  # [B, N]
        depth_total = logits.new_zeros((), dtype=torch.float32)
        for d in range(self.num_depths):
            m = (mask & (depth == d)).float()
            if not bool(m.any()):
                continue
            loss_d = (per * m).sum() / m.sum()
            depth_total = depth_total + self.step_decay**d * loss_d
            metrics[f"loss_{d}"] = loss_d.detach()
            metrics[f"acc_{d}"] = (hits.float() * m).sum() / m.sum()
            if alpha is not None:
                metrics[f"alpha_{d}"] = (alpha * m).sum() / m.sum()
        metrics["elements"] = valid.sum().float() / B
        if self.loss_mean == "depth":
            return depth_total, metrics
        m = mask.float()
        return (per * weight * m).sum() / m.sum().clamp(min=1.0), metrics

    def elements_per_row(self, positions: int) -> float:
        """The elements COD sampling keeps of a row of ``positions`` trained positions, about: every position at depth
        0, and at each deeper depth d ``max(cod_ratio ** d, cod_min_ratio)`` of the anchors they are drawn from (at
        most ``max_anchors`` of the positions). The FLOP count and the memory planner both read it."""
        seeds = min(positions, self.max_anchors or positions)
        return positions + seeds * sum(max(self.cod_ratio**d, self.cod_min_ratio) for d in range(1, self.num_depths))

    def activation_bytes(self, step: PlannedStep) -> int:
        """EAGLE-3's target phase (soft labels) against one parallel forward over the COD-sampled elements of every
        depth: the first layer (2H attention input), the plain layers after it, the logits with their float32
        log-softmax, product and labels, and the target's own probabilities (a loss other than ``kl`` keeps three more
        float32 [elements, Vd] tensors for backward), beside the target states the elements read."""
        n, a = step.tokens, step.element
        d = self.draft_layer_shape()
        t = Shape.of(self.target_config)
        target_phase, handed = self.target_phase_bytes(step, soft=True)
        elements = int(step.batch * self.elements_per_row(step.seq))
        deeper = (self.drafter.num_decoder_layers - 1) * layer_saved(d, elements, a)
        copies = 4 if self.loss_spec.is_kl else 7
        one = layer_saved(d, elements, a, extra_hidden=2) + deeper + elements * d.vocab_size * (a + copies * F32)
        states = n * len(self.drafter.config.aux_layers) * t.hidden_size * step.target_element
        return max(target_phase, handed + states + one)

    def flops_per_token(self) -> float:
        seq = self.data_seq_len()
        drafter = 2.0 * count_params(self.drafter) * self.elements_per_row(seq) / seq
        return 3.0 * drafter + causal_lm_flops_per_token(self.target.model, 1024)

    def drafter_record(self) -> DrafterRecord:
        architectures = getattr(self.target.config, "architectures", None) or []
        return peagle_kind.make_record(self.drafter.config, self.target_path, architectures, self.num_depths)
