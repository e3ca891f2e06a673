"""The Domino drafter: the DFlash drafter (trainer/methods/dflash/module.py) with Domino's causal correction head
(Huang et al., arXiv 2605.29707; SpecForge's ``DominoDraftModel``) as its block refiner
(trainer/methods/dflash/refiner.py).

A DFlash block drafts every slot at once, so slot ``k`` cannot see the drafts before it. Domino adds a logit delta
that does: a one-layer GRU (no biases) reads the target's input embeddings of the block's tokens before slot k's
(the anchor, then the drafts of slots 1..k-1; the data's tokens in training), and its state ``g_k`` after them, with
the slot's own normed output ``h_k``, gives

    logits_k = lm_head(h_k) + embed_proj.2(silu(embed_proj.0([h_k; g_k])))      for slots k > pure_draft_prefix_len

``embed_proj.0`` maps ``H + G`` to a rank ``e`` (``emb_dim``), ``embed_proj.2`` maps ``e`` back to the vocabulary:
a low-rank logit delta (refiner.py ``LogitBias``: features ``silu(embed_proj.0([h_k; g_k]))`` [n, e], weight
``embed_proj.2.weight`` [V, e]). Slots ``1..pure_draft_prefix_len`` keep the backbone's logits alone. Drafting
resolves the block left to right, one GRU step and one ``[e, V]`` projection per slot, never a drafter forward.

Parameter names are SpecForge's (``prefix_gru.weight_ih_l0`` [3G, H], ``prefix_gru.weight_hh_l0`` [3G, G],
``embed_proj.0.weight`` [e, H + G], ``embed_proj.2.weight`` [V, e]), so that the ``domino`` export is the state
dict itself. SpecForge's ``shift_label`` alignment (the anchor slot drafting the first token) is not implemented: its
value is False here (export.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer.methods.dflash.module import DFlashConfig, DFlashDrafter

HEAD_KEYS = ("emb_dim", "gru_hidden_dim", "pure_draft_prefix_len")
"""The config fields of the correction head (:class:`DominoConfig`), written in the export's ``dflash_config``."""


def check_head(emb_dim: int, gru_hidden_dim: int, pure_draft_prefix_len: int, block_size: int) -> None:
    """Refuse head settings that make no drafter, naming the value (a ValueError: the objective turns it into a
    recipe error naming ``model.<key>``, the loader into a folder error)."""
    for key, value in (("emb_dim", emb_dim), ("gru_hidden_dim", gru_hidden_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key}={value!r} must be an integer >= 1 (SpecForge's Qwen3-8B drafter: 256, 1024)")
    p = pure_draft_prefix_len
    if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p <= block_size - 2:
        raise ValueError(
            f"pure_draft_prefix_len={p!r} must be an integer in 0..{block_size - 2} (block_size {block_size}): the "
            "leading slots left uncorrected, at least one slot corrected"
        )


@dataclass
class DominoConfig(DFlashConfig):
    """The DFlash drafter's shape and Domino's correction head.

    Attributes:
        emb_dim: e, the rank of the logit delta (``embed_proj``'s inner width).
        gru_hidden_dim: G, the GRU's state width.
        pure_draft_prefix_len: p, the leading slots (1..p) drafted from the backbone's logits alone. 1 in
            SpecForge's published config and the one value SGLang's Domino rollout drafts; a file without the key
            is read as 0, the reference model's default.
    """

    emb_dim: int = 256
    gru_hidden_dim: int = 1024
    pure_draft_prefix_len: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_head(self.emb_dim, self.gru_hidden_dim, self.pure_draft_prefix_len, self.block_size)

    def head(self) -> dict:
        """The head's fields (:data:`HEAD_KEYS`) and their values."""
        return {key: getattr(self, key) for key in HEAD_KEYS}


class DominoDrafter(DFlashDrafter):
    """The DFlash drafter with Domino's GRU and low-rank logit delta."""

    refiner_modules = ("prefix_gru", "embed_proj")

    def __init__(self, config: DominoConfig) -> None:
        """
        Args:
            config: the drafter's shape and head.
        """
        super().__init__(config)
        c = config
        self.prefix_gru = nn.GRU(c.hidden_size, c.gru_hidden_dim, num_layers=1, bias=False, batch_first=True)
        self.embed_proj = nn.Sequential(
            nn.Linear(c.hidden_size + c.gru_hidden_dim, c.emb_dim, bias=False),
            nn.SiLU(),
            nn.Linear(c.emb_dim, c.vocab_size, bias=False),
        )
        # the delta's output projection starts at zero, so a new head adds nothing: the corrected logits start as the
        # backbone's (a plain DFlash drafter's), and the head grows from there (its input projection HF's normal, std
        # 0.02; the GRU keeps torch's)
        nn.init.normal_(self.embed_proj[0].weight, std=0.02)
        nn.init.zeros_(self.embed_proj[2].weight)

    def prefix_states(self, embeds: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The GRU over token embeddings ``embeds`` [u, T, H] from ``state`` [1, u, G] (None: zeros): its states
        after each token [u, T, G] and the last [1, u, G]."""
        gru = self.prefix_gru
        return gru(embeds.to(gru.weight_ih_l0.dtype), state)

    def features(self, hidden: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """The logit delta's low-rank features [..., e] of slots' normed outputs ``hidden`` [..., H] and the GRU's
        states after their block's previous tokens ``states`` [..., G]."""
        first = self.embed_proj[0]
        return F.silu(first(torch.cat([hidden.to(first.weight.dtype), states.to(first.weight.dtype)], dim=-1)))

    def delta(self, features: torch.Tensor) -> torch.Tensor:
        """The logit delta [..., V] of :meth:`features` [..., e]."""
        return self.embed_proj[2](features)
