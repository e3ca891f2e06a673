"""DFlash2's local dynamic convolutions around each sublayer of a draft layer (speculators 0.9 ``models/dflash2``).

Each of a layer's two sublayers (attention, MLP) is wrapped by one :class:`DynamicConv`: its normalised input ``x``
is convolved before the sublayer and the sublayer's output after it, each with its own kernel, inside the block only
(slot ``k`` mixes slots ``k - j`` for taps ``j < conv_kernel_size`` with ``k - j >= 0``; nothing crosses a block's
edge, nothing reads a later slot):

    y_k = sum_j x_{k - j} * (base[j] + delta_k[j])         (per channel; delta shared by a group of channels)

``base`` [kernel, H] is a learned kernel per channel; ``delta_k`` [kernel, H / group] is dynamic, a linear map of the
sublayer's input at slot k (``kernel_projection``, one map giving both the input and output kernels). Both convolutions
start as the identity (``base[0] = 1``, the other taps and the projection 0), so a new DFlash2 layer computes what a
DFlash layer does. With ``x`` the layer's input, a DFlash2 layer is:

    a, d_a = attention_conv.prepare(input_layernorm(h))        (the convolved input, the output kernel's delta)
    h = h + attention_conv.finish(o_proj(attention(a)), d_a)   (queries, the block's keys and values from a)
    m, d_m = mlp_conv.prepare(post_attention_layernorm(h))
    h = h + mlp_conv.finish(mlp(m), d_m)

The context's keys and values are the target's, unchanged (:class:`DFlash2Layer` keeps DFlash's ``kv``). Parameter
names are speculators' (``layers.{i}.attention_conv.base_kernel`` [2, kernel, H],
``layers.{i}.attention_conv.kernel_projection.weight`` [2 * kernel * H / group, H], the same under ``mlp_conv``).
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.methods.dflash.module import DFlashConfig, DFlashLayer, _rope


def check_conv(hidden_size: int, block_size: int, kernel_size: int, group_size: int) -> None:
    """Refuse a convolution that does not fit the drafter, naming the value (a ValueError: the objective turns it
    into a recipe error naming ``model.<key>``, the loaders into a folder error)."""
    for key, value in (("conv_kernel_size", kernel_size), ("conv_group_size", group_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key}={value!r} must be an integer >= 1")
    if kernel_size > block_size:
        raise ValueError(f"conv_kernel_size={kernel_size} cannot exceed block_size={block_size} (taps stay in a block)")
    if hidden_size % group_size:
        raise ValueError(f"conv_group_size={group_size} must divide the drafter's hidden_size {hidden_size}")


def block_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """The grouped dynamic convolution inside blocks of ``block_size`` slots.

    x: [B, Q, H] (Q slots, blocks of ``block_size`` back to back from slot 0); delta: [B, Q, K, G] each slot's dynamic
    taps of its G channel groups; base: [K, H] the learned taps -> [B, Q, H], slot k of a block the sum over taps
    j <= k of ``x_{k - j} * (base[j] + delta_k[j])``.
    """
    B, Q, H = x.shape
    K, G = base.shape[0], delta.shape[-1]
    groups = x.view(B, Q, G, H // G)  # [B, Q, G, H/G]
    slot = torch.arange(Q, device=x.device).remainder(block_size)  # [Q]
    out = torch.zeros_like(groups)
    for tap in range(K):
        shifted = groups if tap == 0 else torch.cat([groups.new_zeros(B, tap, G, H // G), groups[:, :-tap]], dim=1)
        coefficient = base[tap].to(x.dtype).view(1, 1, G, H // G) + delta[:, :, tap, :, None]  # [B, Q, G, H/G]
        valid = (slot >= tap).view(1, Q, 1, 1)  # a tap never reaches into the block before
        out = out + shifted * coefficient * valid
    return out.view(B, Q, H)


class DynamicConv(nn.Module):
    """A sublayer's input and output convolutions, both driven by one projection of its input."""

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int, group_size: int) -> None:
        """
        Args:
            hidden_size: H, the channels.
            block_size: b, the slots of a block (taps stay inside one).
            kernel_size: K, the taps (slot k reads slots k - K + 1 .. k).
            group_size: channels sharing one dynamic tap (H / group_size groups).
        """
        super().__init__()
        check_conv(hidden_size, block_size, kernel_size, group_size)
        self.block_size, self.kernel_size, self.num_groups = block_size, kernel_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [2, K, H]: input, output
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Both convolutions the identity (speculators' initialisation: a new layer is a DFlash layer)."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0].fill_(1.0)
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, Q, H] the sublayer's input -> (its convolution [B, Q, H], the output kernel's taps [B, Q, K, G])."""
        kernels = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.num_groups)
        return block_conv(x, kernels[..., 0, :, :], self.base_kernel[0], self.block_size), kernels[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """y: [B, Q, H] the sublayer's output, delta: the taps :meth:`prepare` gave -> [B, Q, H]."""
        return block_conv(y, delta, self.base_kernel[1], self.block_size)


class DFlash2Layer(DFlashLayer):
    """A DFlash layer with a dynamic convolution around its attention and its MLP (the module docstring)."""

    def __init__(self, config: DFlashConfig, kernel_size: int, group_size: int) -> None:
        """
        Args:
            config: the drafter's shape.
            kernel_size: the convolutions' taps.
            group_size: channels sharing one dynamic tap.
        """
        super().__init__(config)
        c = config
        self.attention_conv = DynamicConv(c.hidden_size, c.block_size, kernel_size, group_size)
        self.mlp_conv = DynamicConv(c.hidden_size, c.block_size, kernel_size, group_size)

    def reset_convolutions(self) -> None:
        """Both convolutions the identity."""
        self.attention_conv.reset_parameters()
        self.mlp_conv.reset_parameters()

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend,
        context: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One layer over the block: DFlash's (:meth:`DFlashLayer.forward`, the same arguments), each sublayer's
        input and output convolved. h: [B, Q, H] (whole blocks, or one block's first slots) -> [B, Q, H]."""
        a = self.self_attn
        x, delta = self.attention_conv.prepare(self.input_layernorm(h))  # [B, Q, H], [B, Q, K, G]
        q = _rope(a.q_norm(self._heads(a.q_proj(x), self.config.num_attention_heads)), cos, sin)
        k, v = self.kv(x, cos, sin)  # [B, nkv, Q, D]
        out = attend(q, k, v, None if context is None else self.kv(*context))  # [B, nh, Q, D]
        B, _, Q, _ = out.shape
        h = h + self.attention_conv.finish(a.o_proj(out.transpose(1, 2).reshape(B, Q, -1)), delta)
        m, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(m), delta)
