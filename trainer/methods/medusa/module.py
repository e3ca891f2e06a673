"""Medusa heads: K extra heads on the target's final normed hidden state; head k guesses the token k + 1 positions
after the next one (the target's own head guesses the next one), without seeing the other heads' guesses.

Head k is ``num_layers`` residual blocks ``x + SiLU(W x + b)`` (W starts at zero, so a new head starts as the
target's head on ``x + SiLU(b)``; b keeps nn.Linear's default init), each with its own weights (the original Medusa
code repeats one block module inside a head, which ties the weights of its layers when there are several: not done
here), then an output layer that starts as a copy of the target's lm_head. Parameter names are vLLM's Medusa
checkpoint names (``blocks.{h}.layers.{l}.weight``/``.bias``, ``lm_heads.{h}.weight``): the export is the state dict.

:class:`MedusaDrafter` is what the ``medusa`` drafter kind holds: the heads, and for Medusa-2 the target trained
with them (``model``), whose changed weights are exported beside the heads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel


@dataclass
class MedusaConfig:
    """The heads' shape.

    Attributes:
        hidden_size: H, the target's hidden size.
        vocab_size: V, the target's output rows.
        num_heads: K, the heads (drafts per round).
        num_layers: residual blocks per head.
        bias: the blocks' linear layers have a bias (vLLM's ``medusa_fc_bias``).
        with_target: Medusa-2: the target was trained with the heads and belongs to the drafter.
    """

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    bias: bool = True
    with_target: bool = False

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(
                f"Medusa needs num_heads >= 1 and num_layers >= 0, got {self.num_heads}, {self.num_layers}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


class MedusaHead(nn.Module):
    """The residual blocks of one head."""

    def __init__(self, config: MedusaConfig) -> None:
        """
        Args:
            config: the heads' shape.
        """
        super().__init__()
        H = config.hidden_size
        self.layers = nn.ModuleList(nn.Linear(H, H, bias=config.bias) for _ in range(config.num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., H] -> [..., H]."""
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """K heads: residual blocks (``blocks``) and output layers (``lm_heads``)."""

    def __init__(self, config: MedusaConfig) -> None:
        """
        Args:
            config: the heads' shape.
        """
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(MedusaHead(config) for _ in range(config.num_heads))
        self.lm_heads = nn.ModuleList(
            nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads)
        )

    def init_from(self, lm_head_weight: torch.Tensor) -> None:
        """Every output layer becomes a copy of the target's lm_head ``[V, H]`` (the embedding, for a target that ties
        them: the heads then start as the target's own next-token head applied one position early)."""
        with torch.no_grad():
            for head in self.lm_heads:
                head.weight.copy_(lm_head_weight)

    def head_hidden(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """hidden: [..., H] the target's final normed hidden states -> head k's features [..., H]."""
        return self.blocks[k](hidden.to(self.lm_heads[k].weight.dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] -> logits of every head [..., K, V] (inference: a few positions at a time)."""
        return torch.stack([head(self.head_hidden(hidden, k)) for k, head in enumerate(self.lm_heads)], dim=-2)


class MedusaDrafter(nn.Module):
    """The heads, and for Medusa-2 the target trained with them."""

    def __init__(self, config: MedusaConfig, model: PreTrainedModel | None = None) -> None:
        """
        Args:
            config: the heads' shape (``with_target`` when ``model`` is given).
            model: the trained target (Medusa-2), or None (Medusa-1: the target is the unchanged original).
        """
        super().__init__()
        if config.with_target != (model is not None):
            raise ValueError("MedusaDrafter: pass the target exactly when config.with_target (Medusa-2)")
        self.config = config
        self.heads = MedusaHeads(config)
        self.model = model
