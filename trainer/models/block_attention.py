"""Block-sparse attention for drafters trained on many draft positions of a sequence in one pass: DFlash's anchored
blocks and EAGLE-3's training-time test (TTT). One mask per pattern, two implementations of it:

- ``flex``: torch's flex attention over a ``BlockMask`` built from the pattern's ``mask_mod``. Fused and compiled, it
  skips tiles the mask leaves empty and saves only the log-sum-exp for backward, never the probabilities. It runs on
  CUDA; on CPU torch 2.13 has no flex backward (``NotImplementedError: FlexAttention does not support backward on
  CPU``), and its uncompiled forward materialises every score, so on CPU it serves the tests only.
- ``dense``: a mask-aware dense computation for each pattern, exact for any device, that never builds the full
  ``[queries, keys]`` mask (see each function). ``impl="auto"`` picks flex on CUDA and dense elsewhere.

DFlash layout (trainer/methods/dflash/module.py). A sequence of ``S`` context positions carries ``N`` blocks of ``b``
slots each; block ``j`` starts at anchor position ``a_j`` and its slots sit at positions ``a_j .. a_j + b - 1``.
Queries: the ``N * b`` slots, block after block. Keys: the ``S`` context entries, then the ``N * b`` slots. Slot
``(j, s)`` sees context entry ``c`` iff ``c < a_j`` (the anchor's own target features are not known when its block
is drafted) and every slot of its own block (non-causal), nothing of other blocks.

EAGLE-3 TTT layout (trainer/methods/eagle3/module.py). At unrolled step ``i`` the keys are those of steps ``0..i`` over
the same ``S`` positions, concatenated in step order; query ``t`` sees the step-0 keys ``0..t`` (causal) and, for
every later step, only the key at its own position ``t``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Literal

import torch

from trainer.interface.errors import RecipeError

Impl = Literal["auto", "flex", "dense"]
IMPLS = ("auto", "flex", "dense")

_compiled_flex: Callable | None = None


def resolve_impl(impl: str, device: torch.device, needs_grad: bool) -> str:
    """``flex`` or ``dense`` for ``impl`` on ``device``; an error naming the value when flex cannot run there."""
    if impl not in IMPLS:
        raise ValueError(f"attention implementation {impl!r} is not one of {IMPLS}")
    if impl == "auto":
        return "flex" if device.type == "cuda" else "dense"
    if impl == "flex" and device.type != "cuda" and needs_grad:
        raise RecipeError(  # a recipe for GPUs run on CPU: the user's to change, named in one line
            f"model.init_args.attention: flex cannot train on {device.type}: torch has no flex-attention backward "
            "there; use dense (or auto, which picks flex on CUDA only)"
        )
    return impl


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_mod, batch: int) -> torch.Tensor:
    """Flex attention of q [B, nh, Q, D] over k, v [B, nkv, K, D] under ``mask_mod(b, h, q_idx, kv_idx)``.

    Compiled on CUDA (fused kernels); elsewhere the uncompiled reference (forward only, every score materialised).
    """
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as flex

    global _compiled_flex
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # repeat rather than enable_gqa: the uncompiled reference path refuses some GQA layouts
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    block_mask = create_block_mask(mask_mod, batch, None, q.shape[2], k.shape[2], device=q.device)
    if q.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex, dynamic=False)
        return _compiled_flex(q, k, v, block_mask=block_mask)
    with warnings.catch_warnings():  # "flex_attention called without torch.compile()": intended off CUDA
        warnings.simplefilter("ignore", UserWarning)
        return flex(q, k, v, block_mask=block_mask)


# ---- DFlash: anchored blocks ---------------------------------------------------------------------------------------


def anchored_block_mask(
    anchors: torch.Tensor,
    context_len: int,
    block: int,
    window: int | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """The DFlash mask written out: bool [B, N * b, S + N * b] (True: may attend), for tests and for reading.

    anchors: [B, N] anchor positions; context_len: S; block: b; window: a block anchored at a sees the context
    a - window .. a - 1 only (speculators' sliding layer, trainer/methods/dflash/module.py); documents: [B, S], the
    context of the anchor's own document only.
    """
    B, N = anchors.shape
    q = torch.arange(N * block, device=anchors.device)  # [Q]
    kv = torch.arange(context_len + N * block, device=anchors.device)  # [K]
    q_block = q // block  # [Q]
    anchor = anchors[:, q_block]  # [B, Q]
    context = (kv[None, None, :] < context_len) & (kv[None, None, :] < anchor[:, :, None])  # [B, Q, K]
    if window is not None:
        context = context & (kv[None, None, :] >= anchor[:, :, None] - window)
    if documents is not None:
        key_doc = documents[:, kv.clamp(max=context_len - 1)]  # [B, K]
        query_doc = documents.gather(1, anchor.clamp(max=context_len - 1))  # [B, Q]
        context = context & (key_doc[:, None, :] == query_doc[:, :, None])
    same = (kv[None, :] >= context_len) & ((kv[None, :] - context_len) // block == q_block[:, None])  # [Q, K]
    return context | same[None]


def anchored_block_mask_mod(
    anchors: torch.Tensor,
    context_len: int,
    block: int,
    window: int | None = None,
    documents: torch.Tensor | None = None,
):
    """The flex ``mask_mod`` of :func:`anchored_block_mask`."""

    last = anchors.shape[1] - 1

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block
        anchor = anchors[b, torch.clamp(q_block, max=last)]  # flex may evaluate padded query indices
        context = (kv_idx < context_len) & (kv_idx < anchor)
        if window is not None:
            context = context & (kv_idx >= anchor - window)
        if documents is not None:
            key = torch.clamp(kv_idx, max=context_len - 1)
            context = context & (documents[b, key] == documents[b, torch.clamp(anchor, max=context_len - 1)])
        same = (kv_idx >= context_len) & ((kv_idx - context_len) // block == q_block)
        return context | same

    return mask_mod


def anchored_block_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    anchors: torch.Tensor,
    block: int,
    impl: Impl = "auto",
    window: int | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """DFlash attention of every block of a batch in one call (the layout in the module docstring).

    Args:
        q: [B, nh, N * b, D] the slots' queries, block after block.
        k_ctx, v_ctx: [B, nkv, S, D] keys and values of the context entries (positions 0..S-1).
        k_blk, v_blk: [B, nkv, N * b, D] keys and values of the slots.
        anchors: [B, N] the anchor position of every block.
        block: b, slots per block.
        impl: ``flex``, ``dense`` or ``auto``.
        window: a block anchored at ``a`` sees the context ``a - window .. a - 1`` only (None: all of ``0..a-1``).
        documents: [B, S] the document of every context position (trainer/models/documents.py): a block sees the context
            of its anchor's document only; None is one document.

    The dense path computes the context scores [B, nh, N * b, S] (masked to each block's prefix) and the
    within-block scores [B, nh, N, b, b] separately and normalises them together: ``N * b * (S + b)`` scores where
    a dense mask over all keys would take ``N * b * (S + N * b)``.

    Returns [B, nh, N * b, D].
    """
    B, nh, Q, D = q.shape
    nkv, S = k_ctx.shape[1], k_ctx.shape[2]
    if Q % block or anchors.shape != (B, Q // block):
        raise ValueError(f"{Q} queries are not {anchors.shape[-1]} blocks of {block} (anchors {tuple(anchors.shape)})")
    if resolve_impl(impl, q.device, torch.is_grad_enabled() and q.requires_grad) == "flex":
        k = torch.cat([k_ctx, k_blk], dim=2)  # [B, nkv, S + Q, D]
        v = torch.cat([v_ctx, v_blk], dim=2)
        return flex_attention(q, k, v, anchored_block_mask_mod(anchors, S, block, window, documents), B)
    N, g = Q // block, nh // nkv
    scale = 1.0 / math.sqrt(D)
    qg = q.reshape(B, nkv, g * Q, D)  # heads h = kv * g + i share kv head kv
    scores_ctx = (qg @ k_ctx.transpose(-1, -2) * scale).view(B, nkv, g, N, block, S)  # [B, nkv, g, N, b, S]
    index = torch.arange(S, device=q.device)[None, None, :]  # [1, 1, S]
    visible = index < anchors[:, :, None]  # [B, N, S]
    if window is not None:
        visible = visible & (index >= anchors[:, :, None] - window)
    if documents is not None:
        visible = visible & (documents[:, None, :] == documents.gather(1, anchors.clamp(max=S - 1))[:, :, None])
    scores_ctx = scores_ctx.masked_fill(~visible[:, None, None, :, None, :], float("-inf"))
    q_blocks = q.view(B, nkv, g, N, block, D)
    k_blocks = k_blk.view(B, nkv, 1, N, block, D)
    scores_blk = q_blocks @ k_blocks.transpose(-1, -2) * scale  # [B, nkv, g, N, b, b]
    scores = torch.cat([scores_ctx, scores_blk], dim=-1)  # [B, nkv, g, N, b, S + b]
    probs = torch.softmax(scores.to(torch.promote_types(q.dtype, torch.float32)), dim=-1).to(q.dtype)
    out = probs[..., :S].reshape(B, nkv, g * Q, S) @ v_ctx  # [B, nkv, g * Q, D]
    out = out.view(B, nkv, g, N, block, D) + probs[..., S:] @ v_blk.view(B, nkv, 1, N, block, D)
    return out.reshape(B, nh, Q, D)


# ---- EAGLE-3: training-time test -----------------------------------------------------------------------------------


def ttt_mask_mod(seq_len: int, step: int = 0, window: int | None = None, documents: torch.Tensor | None = None):
    """The flex ``mask_mod`` of EAGLE-3's TTT step ``step`` over the keys of steps 0..step concatenated (``seq_len``
    each), with an optional sliding ``window`` and ``documents`` [B, S] (trainer/models/documents.py); see
    trainer/methods/eagle3/module.py's ``ttt_attention`` for what the window keeps."""

    def mask_mod(b, h, q_idx, kv_idx):
        key_step, pos = kv_idx // seq_len, kv_idx % seq_len
        first = (key_step == 0) & (pos <= q_idx)
        diagonal = (key_step > 0) & (pos == q_idx)
        if window is not None:  # the query sits at position q_idx + step, step 0's keys at pos, step j's at q_idx + j
            first = first & (q_idx + step - pos < window)
            diagonal = diagonal & (step - key_step < window)
        if documents is not None:
            last = seq_len - 1  # flex may evaluate padded query indices
            first = first & (documents[b, pos] == documents[b, torch.clamp(q_idx, max=last)])
        return first | diagonal

    return mask_mod


def ttt_flex_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    window: int | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """EAGLE-3's TTT attention at step ``len(keys) - 1`` by flex attention. q: [B, nh, S, D]; keys[j], values[j]:
    [B, nkv, S, D]; window: the sliding window or None; documents: [B, S] or None -> [B, nh, S, D]."""
    S = q.shape[2]
    k, v = torch.cat(list(keys), dim=2), torch.cat(list(values), dim=2)  # [B, nkv, (i + 1) S, D]
    return flex_attention(q, k, v, ttt_mask_mod(S, len(keys) - 1, window, documents), q.shape[0])
