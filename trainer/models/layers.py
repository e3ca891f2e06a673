"""Building blocks that more than one drafter uses: Llama's RMSNorm, the gated (SwiGLU) MLP, the attention's
projections and the key/value repeat of grouped-query attention.

The parameter names (``weight``; ``gate_proj``, ``up_proj``, ``down_proj``; ``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, ``q_norm``, ``k_norm``) are the Llama / Qwen checkpoint names,
which the drafters' native exports write as they are: a drafter that uses these blocks keeps the state-dict keys of
the checkpoints it reads and writes (``midlayer.mlp.gate_proj.weight``, ``layers.0.input_layernorm.weight``, ...).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama's RMSNorm: ``weight * x / sqrt(mean(x ** 2) + eps)`` over the last dimension, computed in float32 and
    cast back to the input's dtype before the weight is applied."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        """
        Args:
            width: the normalised (last) dimension.
            eps: added to the mean square.
        """
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))  # [W]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., W] -> [..., W]."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # [..., W] float32
        return self.weight * x.to(dtype)


class GatedMLP(nn.Module):
    """The gated MLP of Llama-family layers: ``down_proj(act(gate_proj(x)) * up_proj(x))``, no biases (SwiGLU with
    the default activation)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    ) -> None:
        """
        Args:
            hidden_size: H, the input and output width.
            intermediate_size: I, the inner width.
            act: the gate's activation (a function, or a module such as ``transformers.activations.ACT2FN[name]``,
                which then is a submodule without parameters).
        """
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)  # [I, H]
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)  # [I, H]
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)  # [H, I]
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., H] -> [..., H]."""
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))  # inner [..., I]


class AttentionProjections(nn.Module):
    """The projections of a Llama-family attention, no biases: ``q_proj``, ``k_proj``, ``v_proj`` from the input
    width to the heads, ``o_proj`` from the heads to the output width, and with ``qk_norm_eps`` Qwen3's per-head
    RMSNorms ``q_norm`` and ``k_norm``. The layer that owns them applies them (its inputs, rotary embedding and mask
    are its own)."""

    def __init__(
        self, in_width: int, out_width: int, heads: int, kv_heads: int, head_dim: int, qk_norm_eps: float | None = None
    ) -> None:
        """
        Args:
            in_width: the width q, k and v are projected from (2H for EAGLE-3's concatenated input).
            out_width: the width o projects back to (H).
            heads: query heads.
            kv_heads: key/value heads (grouped-query attention when fewer than ``heads``).
            head_dim: D, the width of a head.
            qk_norm_eps: with a value, per-head RMSNorms of queries and keys with that epsilon; None: none.
        """
        super().__init__()
        self.q_proj = nn.Linear(in_width, heads * head_dim, bias=False)  # [nh D, in]
        self.k_proj = nn.Linear(in_width, kv_heads * head_dim, bias=False)  # [nkv D, in]
        self.v_proj = nn.Linear(in_width, kv_heads * head_dim, bias=False)  # [nkv D, in]
        self.o_proj = nn.Linear(heads * head_dim, out_width, bias=False)  # [out, nh D]
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Keys or values of grouped-query attention repeated for every query head of their group: each key/value head
    ``j`` becomes heads ``j * groups .. (j + 1) * groups - 1``.

    Args:
        x: [B, nkv, S, D].
        groups: query heads per key/value head (``nh // nkv``).

    Returns:
        [B, nkv * groups, S, D] (``x`` itself when ``groups`` is 1).
    """
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)
