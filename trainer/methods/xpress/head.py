"""XPress's causal refiner head on a DFlash drafter (speculators 0.9 ``models/xpress``), the block refiner of this
method.

A DFlash block drafts every slot at once, so slot ``k`` cannot know what the slots before it drafted. The refiner adds
a logit bias to every slot of a block, built in a low-rank space of width r from three inputs per slot: the token
before the slot's token (``prev``), the slot's own normed output ``h_k`` and the block's summary, the mean ``g`` of the
block's outputs (the anchor slot's included), mixed causally across the block:

    a_k = in_proj([down_h(h_k); down_g(g); token_embed(prev_k)])            [r]
    c_k = a_k + sum_{j <= k} L[:, k, j] * a_j                               (per channel: mix_l [r, b, b], lower part)
    x_k = c_k + mlp_down(silu(mlp_gate(c_k)) * mlp_up(c_k))                 (SwiGLU, hidden r * mlp_ratio)
    bias_k = readout(x_k)                                                   [V]

so slot k's bias depends on the tokens before slots 0..k, i.e. on the drafts before it. ``prev`` of slot 0 (the anchor)
is the token before the anchor (the anchor itself at a row's start), of slot 1 the anchor, of slot k the token at
slot k - 1. The first two inputs are the same in every refine pass (:meth:`XPressRefinerHead.hidden_cache`), so a pass
costs the embedding, the mixer, the MLP and the readout. Parameter names and initialisation are speculators' (every
linear map and the embedding normal with std 0.02, ``mix_l`` zero; ``causal_tril`` is not saved), so that the
``xpress`` export is the state dict itself.

The Jacobi passes (:meth:`XPressRefinerHead.jacobi`) are one function for training and drafting: the seed is the
drafter's own argmax of each slot, and every pass conditions every slot on the previous pass's argmax of the slots
before it. Training's free-running rounds are its first passes (objective.py), and the greedy proposer's K passes the
same ones (proposer.py): the logits a round trains are the logits a pass drafts from.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


def check_refiner(rank: int, mlp_ratio: int, passes: int) -> None:
    """Refuse refiner settings that do not make a drafter, naming the value (a ValueError: the objective turns it into
    a recipe error naming ``model.<key>``, the loaders into a folder error)."""
    checks = (("xpress_rank", rank, 1), ("xpress_mlp_ratio", mlp_ratio, 1), ("num_jacobi_passes", passes, 0))
    for key, value, low in checks:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{key}={value!r} must be an integer >= {low}")


class XPressRefinerHead(nn.Module):
    """The causal refiner: a logit bias [..., b, V] of a block's slots from their previous tokens and outputs."""

    causal_tril: torch.Tensor

    def __init__(self, vocab_size: int, hidden_size: int, block_size: int, rank: int, mlp_ratio: int) -> None:
        """
        Args:
            vocab_size: V, the target's vocabulary (the previous tokens' ids and the biased logits).
            hidden_size: H, the drafter's width.
            block_size: b, slots per block (the mixer's size).
            rank: r, the width of the refiner's space.
            mlp_ratio: the SwiGLU MLP's hidden width is ``r * mlp_ratio``.
        """
        super().__init__()
        r = rank
        self.token_embed = nn.Embedding(vocab_size, r)
        self.down_h = nn.Linear(hidden_size, r, bias=False)
        self.down_g = nn.Linear(hidden_size, r, bias=False)
        self.in_proj = nn.Linear(3 * r, r, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(r, block_size, block_size))
        self.mlp_gate = nn.Linear(r, r * mlp_ratio, bias=False)
        self.mlp_up = nn.Linear(r, r * mlp_ratio, bias=False)
        self.mlp_down = nn.Linear(r * mlp_ratio, r, bias=False)
        self.readout = nn.Linear(r, vocab_size, bias=False)
        self.register_buffer("causal_tril", torch.tril(torch.ones(block_size, block_size)), persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def hidden_cache(self, hidden: torch.Tensor) -> torch.Tensor:
        """The pass-invariant features of blocks' normed outputs: hidden [..., b, H] -> [..., b, 2r]
        ``[down_h(h_k); down_g(g)]``, g the block's mean output."""
        hidden = hidden.to(self.down_h.weight.dtype)
        g = hidden.mean(dim=-2, keepdim=True).expand_as(hidden)  # [..., b, H]
        return torch.cat([self.down_h(hidden), self.down_g(g)], dim=-1)

    def features(self, prev: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """The slots' refined features x [..., b, r] (the bias is ``readout(x)``) of the tokens before each slot's
        token ``prev`` [..., b] and the blocks' :meth:`hidden_cache` [..., b, 2r]."""
        lat = self.token_embed(prev.long()).to(cache.dtype)  # [..., b, r]
        a = self.in_proj(torch.cat([cache, lat], dim=-1))  # [..., b, r]
        lower = self.mix_l * self.causal_tril.to(self.mix_l.dtype)  # [r, b, b]
        x = a + torch.einsum("ckj,...jc->...kc", lower, a)  # [..., b, r]: slot k mixes slots 0..k
        return x + self.mlp_down(F.silu(self.mlp_gate(x)) * self.mlp_up(x))

    def bias(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., r] -> [..., V] the logit bias."""
        return self.readout(features.to(self.readout.weight.dtype))

    def refine(
        self, base: torch.Tensor, cache: torch.Tensor, first: torch.Tensor, drafts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The refined logits of a block's first k drafted slots given drafts before them.

        Args:
            base: [..., k, V] the lm_head's logits of slots 1..k (k <= b - 1).
            cache: [..., b, 2r] the blocks' :meth:`hidden_cache`.
            first: [..., 2] the token before the anchor (the anchor itself at a sequence's start) and the anchor.
            drafts: [..., m] the drafts of slots 1..m (slot k reads those of slots 1..k - 1; the rest may be anything).

        Returns:
            prev [..., b] the token before each slot's token (slots past what ``drafts`` gives read the anchor: no
            slot up to k reads them), the features [..., k, r] of slots 1..k and their logits ``base + bias`` [..., k,
            V] in at least float32.
        """
        b, k = cache.shape[-2], base.shape[-2]
        known = torch.cat([first, drafts[..., : b - 2]], dim=-1).long()  # [..., <= b]
        prev = first[..., 1:].expand(*known.shape[:-1], b).clone()  # [..., b]: the anchor
        prev[..., : known.shape[-1]] = known
        features = self.features(prev, cache)[..., 1 : k + 1, :]  # [..., k, r]
        dtype = torch.promote_types(base.dtype, torch.float32)
        return prev, features, base.to(dtype) + self.bias(features).to(dtype)

    def jacobi(
        self, base: torch.Tensor, cache: torch.Tensor, first: torch.Tensor, passes: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The first ``passes`` Jacobi passes of blocks: pass 1 conditions every slot on the drafter's parallel argmax
        of ``base`` (the seed), pass j on pass j - 1's argmax; yields each pass's :meth:`refine` (prev, features,
        logits). Each pass's argmax is taken before the pass is yielded, so the caller may overwrite the logits it is
        given (training's losses take their softmax in place). Arguments as :meth:`refine`. After pass j the first j
        slots' argmax equal the left-to-right resolution (each slot's argmax given the drafts before it); a pass whose
        argmax equals its input's is a fixed point, which every later pass repeats."""
        # max's indices are argmax's (the first of equal maxima) and, on one CPU thread, about 1.7x faster to take
        drafts = base.max(-1).indices  # [..., k]: the seed
        for j in range(passes):
            prev, features, logits = self.refine(base, cache, first, drafts)
            if j + 1 < passes:
                drafts = logits.max(-1).indices  # [..., k] the next pass's input
            yield prev, features, logits
