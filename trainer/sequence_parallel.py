"""Sequence parallelism for rows longer than one GPU holds: DeepSpeed-Ulysses around an attention function.

Under Ulysses each of the ``P`` ranks of a sequence-parallel group holds ``S / P`` consecutive positions of every row
for everything but attention (embeddings, projections, MLP, logits: their activations divided by ``P``). Around the
attention, DeepSpeed's ``DistributedAttention`` (``deepspeed.sequence.layer``) exchanges queries, keys and values by
one all-to-all each so that every rank holds the whole sequence for ``1 / P`` of the heads, runs the attention
function unchanged on that, and exchanges the output back; its backward is the reverse all-to-all. Any mask the
attention function applies over the whole sequence (causal, EAGLE-3's training-time test, documents, a window) is
therefore unchanged. :func:`ulysses_attention` wraps a function of the project's layout (``[B, heads, S, D]``, keys
and values as one tensor or a list of tensors over the same positions, as EAGLE-3's TTT steps pass them).

Checked on CPU (torch 2.13, deepspeed 0.19.8, gloo): gloo runs ``all_to_all_single``, and two processes through
:func:`ulysses_attention` give the single process's output and gradients (tests/unit/test_sequence_parallel.py).
PyTorch's own context parallel (``torch.distributed.tensor.experimental.context_parallel``, ring attention) does not
run on CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` has no sharding strategy registered there.

Requirements (refused by :func:`check_sequence_parallel`): the key/value heads divide by ``P`` (a query head must land
on the rank of its key/value head), and the sequence length divides by ``P``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from trainer.errors import RecipeError

AttentionFn = Callable[..., torch.Tensor]


def check_sequence_parallel(size: int, kv_heads: int, seq_len: int, key: str = "sequence_parallel_size") -> None:
    """Refuses a sequence-parallel degree Ulysses cannot run, naming ``key`` and the value.

    Args:
        size: the sequence-parallel degree P (1: none).
        kv_heads: key/value heads of the attention it wraps.
        seq_len: tokens per row.
        key: the recipe key or flag that set ``size``, for the message.
    """
    if size < 1:
        raise RecipeError(f"{key}={size}: the sequence-parallel degree is a positive number of ranks")
    if kv_heads % size:
        raise RecipeError(f"{key}={size} does not divide the attention's {kv_heads} key/value heads (Ulysses)")
    if seq_len % size:
        raise RecipeError(f"{key}={size} does not divide data.seq_len={seq_len} (each rank holds S / {size} positions)")


def ulysses_attention(attention: AttentionFn, group: torch.distributed.ProcessGroup | None = None) -> AttentionFn:
    """``attention`` run over the whole sequence under DeepSpeed-Ulysses, called with each rank's slice.

    Args:
        attention: ``attention(q, keys, values, *args)`` with q [B, nh, S, D] and keys, values a tensor [B, nkv, S, D]
            or a sequence of them, returning [B, nh, S, D]; ``args`` (masks, documents, window...) are passed as they
            are, so whatever they describe must cover the whole sequence.
        group: the sequence-parallel process group (None: the default group); DeepSpeed's communication must be
            initialised (``deepspeed.init_distributed``).

    Returns:
        ``wrapped(q, keys, values, *args)`` taking each rank's consecutive slice of positions (q [B, nh, S / P, D],
        keys and values [B, nkv, S / P, D] or sequences of them) and returning that slice of the output
        [B, nh, S / P, D]; autograd reaches q, keys and values through DeepSpeed's all-to-all.
    """
    from deepspeed.sequence.layer import DistributedAttention

    def local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, listed: bool, *args) -> torch.Tensor:
        # [B, S, h / P, D] (k, v: [B, S, nkv / P, count * D]) -> [B, S, h / P, D]
        q = q.transpose(1, 2)  # [B, h / P, S, D]
        keys = [t.transpose(1, 2) for t in k.chunk(count, dim=-1)]  # count x [B, nkv / P, S, D]
        values = [t.transpose(1, 2) for t in v.chunk(count, dim=-1)]
        out = attention(q, keys if listed else keys[0], values if listed else values[0], *args)  # [B, h / P, S, D]
        return out.transpose(1, 2)

    distributed = DistributedAttention(local, group or torch.distributed.group.WORLD, scatter_idx=2, gather_idx=1)

    def wrapped(
        q: torch.Tensor,
        keys: torch.Tensor | Sequence[torch.Tensor],
        values: torch.Tensor | Sequence[torch.Tensor],
        *args,
    ) -> torch.Tensor:
        listed = not isinstance(keys, torch.Tensor)
        keys = list(keys) if listed else [keys]
        values = list(values) if listed else [values]
        k = torch.cat([t.transpose(1, 2) for t in keys], dim=-1)  # [B, S / P, nkv, count * D]
        v = torch.cat([t.transpose(1, 2) for t in values], dim=-1)
        out = distributed(q.transpose(1, 2).contiguous(), k, v, 0, None, len(keys), listed, *args)  # [B, S / P, nh, D]
        return out.transpose(1, 2)  # [B, nh, S / P, D]

    return wrapped


ULYSSES_SDPA = "ulysses_sdpa"
"""The attention implementation :func:`register_ulysses_sdpa` registers with transformers."""


def register_ulysses_sdpa(group: torch.distributed.ProcessGroup | None = None) -> str:
    """Registers with transformers (``AttentionInterface``, ``AttentionMaskInterface``) an attention implementation
    that runs torch's causal SDPA over the whole row under DeepSpeed-Ulysses, for a frozen target whose forward each
    rank runs on its slice of the row (``position_ids`` counted from the slice's first global position).

    The row is causal and whole: no padding and no document mask (the mask function refuses a padding mask that is
    not all ones; transformers would otherwise build a mask over the local slice only, which is wrong here).

    Args:
        group: the sequence-parallel process group (None: the default group).

    Returns:
        the implementation's name, :data:`ULYSSES_SDPA`, for ``model.set_attn_implementation``.
    """
    import torch.nn.functional as F
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]  # q: [B, h / P, S, D]; k, v: [B, kv / P, S, D]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)  # [B, h / P, S, D]

    wrapped = ulysses_attention(causal, group)

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        # query: [B, h, S / P, D]; key, value: [B, kv, S / P, D] -> ([B, S / P, h, D], None) as transformers' sdpa
        return wrapped(query, key, value, scaling).transpose(1, 2).contiguous(), None

    def no_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(f"{ULYSSES_SDPA}: rows with padding or document masks are not supported (whole rows only)")
        return None

    AttentionInterface.register(ULYSSES_SDPA, attention)
    AttentionMaskInterface.register(ULYSSES_SDPA, no_mask)
    return ULYSSES_SDPA
