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

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from trainer.interface.errors import RecipeError
from trainer.models.documents import allowed_keys

AttentionFn = Callable[..., torch.Tensor]


def check_sequence_parallel(
    size: int, kv_heads: int, seq_len: int, key: str = "sequence_parallel_size", rows_key: str = "data.seq_len"
) -> None:
    """Refuses a sequence-parallel degree Ulysses cannot run, naming ``key`` and the value.

    Args:
        size: the sequence-parallel degree P (1: none).
        kv_heads: key/value heads of the attention it wraps.
        seq_len: tokens per row.
        key: the recipe key or flag that set ``size``, for the message.
        rows_key: the recipe key that set ``seq_len``, for the message.
    """
    if size < 1:
        raise RecipeError(f"{key}={size}: the sequence-parallel degree is a positive number of ranks")
    if kv_heads % size:
        raise RecipeError(f"{key}={size} does not divide the attention's {kv_heads} key/value heads (Ulysses)")
    if seq_len % size:
        raise RecipeError(f"{key}={size} does not divide {rows_key}={seq_len} (each rank holds S / {size} positions)")


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

_ROW_DOCUMENTS: ContextVar[torch.Tensor | None] = ContextVar("row_documents", default=None)
"""[B, S] the whole row's documents while :func:`whole_row_target` runs, else None."""


def register_ulysses_sdpa(group: torch.distributed.ProcessGroup | None = None) -> str:
    """Registers with transformers (``AttentionInterface``, ``AttentionMaskInterface``) an attention implementation
    that runs torch's SDPA over the whole row under DeepSpeed-Ulysses, for a frozen target whose forward each rank runs
    on its slice of the row (``position_ids`` counted from the slice's first global position, or within each document).

    The row is causal and whole: no padding (the mask function refuses a padding mask that is not all ones;
    transformers would otherwise build a mask over the local slice only, which is wrong here). A packed row's documents
    reach it through :func:`whole_row_target`: then each position attends within its own document (a dense
    [B, 1, S, S] boolean mask over the whole row).

    Args:
        group: the sequence-parallel process group (None: the default group).

    Returns:
        the implementation's name, :data:`ULYSSES_SDPA`, for ``model.set_attn_implementation``.
    """
    import torch.nn.functional as F
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None, documents) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]  # q: [B, h / P, S, D]; k, v: [B, kv / P, S, D]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if documents is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)  # [B, h / P, S, D]
        positions = torch.arange(q.shape[2], device=q.device)  # [S]
        mask = allowed_keys(positions, positions, documents, documents)  # [B, S, S]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scaling)

    wrapped = ulysses_attention(causal, group)

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        # query: [B, h, S / P, D]; key, value: [B, kv, S / P, D] -> ([B, S / P, h, D], None) as transformers' sdpa
        out = wrapped(query, key, value, scaling, _ROW_DOCUMENTS.get())
        return out.transpose(1, 2).contiguous(), None

    def no_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(f"{ULYSSES_SDPA}: rows with padding are not supported (whole rows only)")
        return None

    AttentionInterface.register(ULYSSES_SDPA, attention)
    AttentionMaskInterface.register(ULYSSES_SDPA, no_mask)
    return ULYSSES_SDPA


@contextmanager
def whole_row_target(model, documents: torch.Tensor | None = None) -> Iterator[None]:
    """Runs ``model`` (an HF model, its config's attention swapped for :data:`ULYSSES_SDPA` and restored after) on
    each rank's slice of the row, attending over the whole row; ``documents`` [B, S] the whole row's documents, or
    None (one document). :func:`register_ulysses_sdpa` must have registered the implementation for the group."""
    before = model.config._attn_implementation
    model.set_attn_implementation(ULYSSES_SDPA)
    token = _ROW_DOCUMENTS.set(documents)
    try:
        yield
    finally:
        _ROW_DOCUMENTS.reset(token)
        model.set_attn_implementation(before)


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in its sequence-parallel group: ``size`` consecutive ranks share every row, rank ``rank`` of
    them holding positions ``rank * S / size .. (rank + 1) * S / size - 1`` (:meth:`part`).

    The ``world / size`` groups are the data-parallel replicas: the samplers give every rank of a group the same rows
    (:func:`data_parallel_rank_world`); gradients are still averaged over every rank, so an objective scales its
    loss's gradient by ``size`` (each rank's share of a group's loss sums to the group's loss).
    """

    size: int
    rank: int
    group: torch.distributed.ProcessGroup | None

    @classmethod
    def build(cls, size: int, key: str = "model.sequence_parallel") -> SequenceParallel:
        """The groups of ``size`` consecutive ranks of the initialised default group (every rank calls this, as
        ``new_group`` needs), DeepSpeed's communication initialised over it when it is not (under DDP), and this
        rank's; refuses a world size ``size`` does not divide, naming ``key``."""
        import deepspeed
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        if world % size:
            raise RecipeError(f"{key}={size} does not divide the {world} ranks (each row is shared by {size} ranks)")
        if not deepspeed.comm.is_initialized():
            deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
        mine = None
        for start in range(0, world, size):
            ranks = list(range(start, start + size))
            group = dist.group.WORLD if size == world else dist.new_group(ranks)
            if rank in ranks:
                mine = group
        return cls(size, rank % size, mine)

    def part(self, length: int) -> slice:
        """This rank's positions of a row of ``length`` (divisible by :attr:`size`)."""
        local = length // self.size
        return slice(self.rank * local, (self.rank + 1) * local)

    def following(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """[B, width, ...] the first ``width`` positions of the next rank's ``x`` [B, S / P, ...] (zeros on the last
        rank: past the row's end); no gradient."""
        import torch.distributed as dist

        head = x[:, :width].detach().contiguous()
        gathered = [torch.empty_like(head) for _ in range(self.size)]
        dist.all_gather(gathered, head, group=self.group)
        return gathered[self.rank + 1] if self.rank + 1 < self.size else torch.zeros_like(head)

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the group (no gradient)."""
        import torch.distributed as dist

        out = x.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out


def data_parallel_rank_world(trainer) -> tuple[int, int]:
    """(rank, world size) among the data-parallel replicas of a Lightning ``trainer`` (rank 0 of 1 without one): the
    ranks of a sequence-parallel group (its module's ``sequence_parallel``, 1 when absent) count as one replica."""
    if trainer is None:
        return 0, 1
    size = int(getattr(trainer.lightning_module, "sequence_parallel", 1))
    return int(trainer.global_rank) // size, int(trainer.world_size) // size
