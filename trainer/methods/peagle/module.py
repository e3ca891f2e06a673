"""P-EAGLE (parallel EAGLE, arXiv 2602.01469): the EAGLE-3 drafter drafting K tokens in one forward.

The network is the EAGLE-3 drafter of trainer/methods/eagle3/module.py (``fc``, its decoder layer ``midlayer``,
``norm``, ``lm_head``, the vocabulary map, the norm flags), plus two learned placeholders, a trainable input embedding
and, with ``num_layers > 1``, plain Llama decoder layers after the first (``deep_layers``), as speculators 0.9's
``PEagleDraftModel``:

- ``embed_tokens`` [V, H]: the drafter's own input embedding (initialised from the target's and trained);
- ``mask_hidden`` [1, 1, n * Ht]: the placeholder of the concatenated target hidden states, fused like real ones
  (``input_norm`` / ``fc_norm`` then ``fc``);
- ``config.mask_token_id``: a token id the target never uses, whose (trained) embedding is the placeholder token;
- ``deep_layers.{i}``: decoder layer ``i + 1`` (``layers.{i + 1}.*`` in speculators' format), over the features alone,
  under the same mask. The paper's released drafters have 4 layers: a placeholder's query at the first layer is the
  same for every anchor (its inputs are), so what it can gather from the context is set by position alone until a
  later layer.

Elements are pairs (anchor ``a``, depth ``d``). Depth 0 is EAGLE-3's element ``a``: the target features of token ``a``
with the embedding of token ``a + 1``; depth ``d >= 1`` of anchor ``a`` is a placeholder (``mask_hidden``,
``mask_token_id``) at rotary position ``a + d``. Element (a, d) predicts token ``a + 2 + d``. Element q sees element k
iff ``k`` is at depth 0 with ``a_k <= a_q`` (the context) or ``k`` is of the same anchor with ``d_k <= d_q`` (its own
rollout): :func:`peagle_mask`. At drafting time the cache holds the depth-0 elements of every committed position and
one forward adds the placeholders of the last one: K drafts in one drafter forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from trainer.methods.eagle3.module import (
    DecoderLayer,
    Eagle3Config,
    Eagle3Drafter,
    cached_attention,
    causal_after,
    masked_attention,
    windowed,
)
from trainer.models.block_attention import Impl, flex_attention, resolve_impl
from trainer.models.documents import allowed_keys, document_positions
from trainer.models.layers import repeat_kv


@dataclass
class PEagleConfig(Eagle3Config):
    """The EAGLE-3 shape plus the placeholder token and the depth of the network.

    Attributes:
        mask_token_id: the placeholder token id (one the target's tokenizer never produces); -1 is unset (refused).
        num_layers: decoder layers: the first (``midlayer``, over the embedding and the features) and
            ``num_layers - 1`` plain ones after it.
    """

    mask_token_id: int = -1
    num_layers: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} must be a token id in 0..{self.vocab_size - 1}")


def peagle_mask(
    anchor: torch.Tensor,
    depth: torch.Tensor,
    valid: torch.Tensor | None = None,
    window: int | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """anchor, depth: [B, N] (valid: [B, N] bool, False for padding) -> allowed [B, 1, N, N] bool.

    Query q sees key k iff (``d_k == 0`` and ``a_k <= a_q``) or (``a_k == a_q`` and ``d_k <= d_q``); padding keys are
    hidden and a padding query sees itself only (no empty rows). With a ``window``, also only keys whose position ``a_k
    + d_k`` is less than ``window`` behind the query's ``a_q + d_q`` (trainer/models/documents.py), as drafting. With
    ``documents`` [B, S] (the row's document_ids, trainer/models/documents.py), also only keys whose anchor is in the
    query anchor's document."""
    aq, ak = anchor[:, :, None], anchor[:, None, :]  # [B, N, 1], [B, 1, N]
    dq, dk = depth[:, :, None], depth[:, None, :]
    allowed = ((dk == 0) & (ak <= aq)) | ((ak == aq) & (dk <= dq))  # [B, N, N]
    if window is not None:
        allowed = allowed & ((aq + dq) - (ak + dk) < window)
    if documents is not None:
        owner = documents.gather(1, anchor)  # [B, N] the document of every element's anchor
        allowed = allowed & (owner[:, :, None] == owner[:, None, :])
    if valid is not None:
        eye = torch.eye(anchor.shape[1], dtype=torch.bool, device=anchor.device)
        allowed = (allowed & valid[:, None, :] & valid[:, :, None]) | eye
    return allowed[:, None]


def peagle_mask_mod(
    anchor: torch.Tensor,
    depth: torch.Tensor,
    valid: torch.Tensor,
    window: int | None = None,
    documents: torch.Tensor | None = None,
):
    """The flex ``mask_mod`` of :func:`peagle_mask` (anchor, depth, valid: [B, N]; the window; documents [B, S])."""
    last = anchor.shape[1] - 1
    owner = None if documents is None else documents.gather(1, anchor)  # [B, N] each element's anchor's document

    def mask_mod(b, h, q_idx, kv_idx):
        q, k = torch.clamp(q_idx, max=last), torch.clamp(kv_idx, max=last)  # flex may evaluate padded indices
        aq, ak, dq, dk = anchor[b, q], anchor[b, k], depth[b, q], depth[b, k]
        rule = ((dk == 0) & (ak <= aq)) | ((ak == aq) & (dk <= dq))
        if window is not None:
            rule = rule & ((aq + dq) - (ak + dk) < window)
        if owner is not None:
            rule = rule & (owner[b, q] == owner[b, k])
        return (rule & valid[b, q] & valid[b, k]) | (q_idx == kv_idx)

    return mask_mod


class PEagleDrafter(Eagle3Drafter):
    """The EAGLE-3 drafter with the P-EAGLE placeholders and its own embedding (see the module docstring)."""

    def __init__(self, config: PEagleConfig) -> None:
        """
        Args:
            config: the drafter's shape and placeholder token.
        """
        super().__init__(config)
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, len(c.aux_layers) * c.target_hidden_size))
        self.deep_layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers - 1))
        for module in self.deep_layers.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    @property
    def num_decoder_layers(self) -> int:
        """``midlayer`` and the ``deep_layers`` after it."""
        return 1 + len(self.deep_layers)

    def placeholder(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds [1, n, H], fused features [1, n, H]) of n placeholder elements."""
        c = self.config
        fused = self.fuse(list(self.mask_hidden[0].split(c.target_hidden_size, dim=-1)))  # [1, H]
        token = torch.full((1, n), c.mask_token_id, dtype=torch.long, device=fused.device)
        return self.embed_tokens(token).to(fused.dtype), fused[None].expand(1, n, -1)

    def parallel(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        anchor: torch.Tensor,
        depth: torch.Tensor,
        valid: torch.Tensor,
        impl: Impl = "dense",
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Training pass over sampled elements -> logits [B, N, Vd].

        Args:
            embeds: [B, n, H] the embeddings of the depth-0 elements' tokens.
            hidden: [B, n, H] their fused target features.
            anchor, depth: [B, N] long; elements 0..n-1 of every row are the depth-0 ones, anchors 0..n-1 in order
                (COD sampling's order), the others placeholders (depth >= 1) or padding.
            valid: [B, N] bool, False for padding.
            impl: the :func:`peagle_mask` attention, dense or flex (trainer/models/block_attention.py, CUDA for
                training).
            documents: [B, S] the row's document_ids (trainer/models/documents.py), or None (one document): an element
                attends within its anchor's document only, at rotary positions counted from that document's start.

        Every placeholder has the same inputs (``mask_token_id``'s embedding, the fused ``mask_hidden``), so their
        first-layer queries, keys and values are projected once and differ by the rotary embedding alone (the deeper
        layers' inputs differ). The dense path splits the mask: depth-0 queries see the depth-0 keys causally (SDPA's
        causal kernel, no mask), placeholders every key under :func:`peagle_mask`.
        """
        B, n, _ = hidden.shape
        order = torch.arange(n, device=anchor.device)
        if not bool(((depth[:, :n] == 0) & (anchor[:, :n] == order)).all()):
            raise ValueError(f"the first {n} elements of every row must be the depth-0 ones (COD sampling's order)")
        P = anchor.shape[1] - n  # placeholders and padding per row
        place_embeds, place_fused = self.placeholder(1)  # [1, 1, H] each
        features = torch.cat([hidden, place_fused.expand(B, P, -1)], dim=1)  # [B, N, H]
        start = anchor  # [B, N] the anchors' rotary positions
        if documents is not None:
            start = document_positions(documents).gather(1, anchor)  # [B, N] counted within each document
        cos, sin = self.rope(features, start + depth)  # [B, N, D] each
        q0, k0, v0 = self.midlayer.project(embeds, hidden)  # [B, nh, n, D], [B, nkv, n, D] x2
        qp, kp, vp = (t.expand(B, -1, P, -1) for t in self.midlayer.project(place_embeds, place_fused))
        q, k = apply_rotary_pos_emb(torch.cat([q0, qp], 2), torch.cat([k0, kp], 2), cos, sin)
        v = torch.cat([v0, vp], dim=2)  # [B, nkv, N, D]
        mask = _ParallelMask(n, anchor, depth, valid, impl, self.config.window, documents)
        h = self.midlayer.finish(features, mask.attend(q, k, v))  # [B, N, H]
        for layer in self.deep_layers:
            h = layer.finish(h, mask.attend(*layer.qkv(h, cos, sin)))
        return self.outputs(h)[1]

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        allowed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """One drafting pass over new elements through every layer, attending to ``past`` and to each other.

        Args:
            embeds: [B, N, H] embeddings of the tokens one ahead of ``hidden`` (``mask_token_id``'s for placeholders).
            hidden: [B, N, H] fused target features (``mask_hidden`` fused for placeholders).
            positions: [B, N] rotary positions.
            past: one cached (k, v) per decoder layer, each [B, nkv, M, D], or None.
            allowed: [N, M + N] (or [B, 1, N, M + N]) bool over past then new keys; None is causal over the new
                elements after all of ``past``.

        Returns:
            the last layer's output [B, N, H] (post-norm with ``norm_output``), logits [B, N, Vd], and each layer's
            (k, v) of the new elements.
        """
        cos, sin = self.rope(hidden, positions)
        if allowed is None:
            allowed = causal_after(hidden.shape[1], 0 if past is None else past[0][0].shape[2], hidden.device)
        allowed = windowed(allowed, self.config.window, positions, 0 if past is None else past[0][0].shape[2])
        new: list[tuple[torch.Tensor, torch.Tensor]] = []

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            new.append((k, v))
            return cached_attention(q, k, v, None if past is None else past[len(new) - 1], allowed)  # [B, nh, N, D]

        h = self.midlayer.finish(hidden, attend(*self.midlayer.qkv(embeds, hidden, cos, sin)))  # [B, N, H]
        for layer in self.deep_layers:
            h = layer.finish(h, attend(*layer.qkv(h, cos, sin)))
        out, logits = self.outputs(h)
        return out, logits, new


@dataclass
class _ParallelMask:
    """The training pass's attention under :func:`peagle_mask`, for every layer: elements ``0..n-1`` of each row are
    the depth-0 ones (queries among them see the depth-0 keys causally: SDPA's causal kernel, no mask), the rest
    placeholders or padding (masked), or one flex pass."""

    n: int
    anchor: torch.Tensor  # [B, N]
    depth: torch.Tensor  # [B, N]
    valid: torch.Tensor  # [B, N]
    impl: Impl
    window: int | None = None
    documents: torch.Tensor | None = None  # [B, S] the row's document_ids, or None

    @cached_property
    def placeholder_rows(self) -> torch.Tensor:
        """[B, 1, P, N] the mask's rows of the elements after the depth-0 ones (built once for every layer)."""
        return peagle_mask(self.anchor, self.depth, self.valid, self.window, self.documents)[:, :, self.n :]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, nh, N, D]; k, v: [B, nkv, N, D] -> [B, nh, N, D]."""
        n, B = self.n, q.shape[0]
        if resolve_impl(self.impl, q.device, torch.is_grad_enabled() and q.requires_grad) == "flex":
            mod = peagle_mask_mod(self.anchor, self.depth, self.valid, self.window, self.documents)
            return flex_attention(q, k, v, mod, B)
        groups = q.shape[1] // k.shape[1]
        keys0, values0 = repeat_kv(k[:, :, :n], groups), repeat_kv(v[:, :, :n], groups)
        if self.window is None and self.documents is None:
            first = F.scaled_dot_product_attention(q[:, :, :n], keys0, values0, is_causal=True)  # [B, nh, n, D]
        else:
            index = torch.arange(n, device=q.device)  # [n]
            docs = None if self.documents is None else self.documents[:, :n]  # [B, n]: element a is anchor a
            causal = allowed_keys(index, index, docs, docs, self.window)  # [n, n] or [B, n, n]
            causal = causal if causal.dim() == 2 else causal[:, None]  # [n, n] or [B, 1, n, n]
            first = F.scaled_dot_product_attention(q[:, :, :n], keys0, values0, attn_mask=causal)  # [B, nh, n, D]
        rest = masked_attention(q[:, :, n:], k, v, self.placeholder_rows)  # [B, nh, P, D]
        return torch.cat([first, rest], dim=2)
