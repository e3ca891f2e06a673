"""The EAGLE-3 drafter: one Llama decoder layer over the next token's embedding and fused target features.

Inputs of element ``t`` of a sequence: the fused features ``h_t`` (at step 0, ``fc`` of the concatenated hidden states
of three target layers at token ``t``; at later drafting steps, the drafter's own output at ``t`` of the step before)
and the embedding of token ``t + 1`` (the target's frozen embedding, passed in by the caller). The layer input is
``cat([input_layernorm(embedding), hidden_norm(h)])`` (embeddings first), so q/k/v projections take width ``2H``;
the residual is the un-normalised ``h``. The output ``o`` (before the final norm) is the feature fed to the next step;
``lm_head(norm(o))`` gives logits over the reduced draft vocabulary, mapped to target ids by ``d2t``.

EAGLE-3.1 options (speculators 0.9 ``Eagle3SpeculatorConfig``; all off by default, so older checkpoints load
unchanged): ``norm_before_residual`` takes the residual after ``hidden_norm``; ``norm_before_fc`` normalises the
concatenated target states with one RMSNorm (``input_norm``) before ``fc``; ``fc_norm`` normalises each target state
with its own RMSNorm (``fc_norm.{j}``) before the concatenation (exclusive with ``norm_before_fc``); ``norm_output``
feeds the post-norm output ``norm(o)`` to the next step (and ``lm_head`` reads it directly), so the features' magnitude
does not drift with depth. :meth:`Eagle3Drafter.outputs` applies ``norm_output`` for both training and drafting.

Parameter names follow the native EAGLE-3 checkpoint (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``,
``t2d``), so the native export is the state dict itself. Attention is computed outside the layer's projections so
that training-time test (:func:`ttt_attention`) and cached drafting (:func:`masked_attention`) share the weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from trainer.models.block_attention import Impl, resolve_impl, ttt_flex_attention
from trainer.models.documents import allowed_keys, document_positions
from trainer.models.layers import AttentionProjections, GatedMLP, RMSNorm, repeat_kv


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default target layers in HF ``hidden_states`` indices: 2, L // 2 and L - 3, clamped to 1..L-1,
    distinct and sorted (a shallow target gets the smallest unused ids instead of repeats: engines refuse repeats)."""
    top = max(1, num_layers - 1)
    ids = sorted({min(max(1, i), top) for i in (2, num_layers // 2, num_layers - 3)})
    spare = [i for i in range(1, top + 1) if i not in ids]
    return tuple(sorted(ids + spare[: 3 - len(ids)]))


@dataclass
class Eagle3Config:
    """The drafter's shape. Stored in checkpoints (``asdict``) and translated by the exporters.

    Attributes:
        hidden_size: H, the drafter's width (the target's hidden size in all released drafters).
        intermediate_size: the MLP's inner width.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention).
        head_dim: width of one head.
        vocab_size: the target's vocabulary size.
        draft_vocab_size: the reduced vocabulary of the draft lm_head.
        target_hidden_size: the target's hidden size (the fc input is ``len(aux_layers) * target_hidden_size``).
        aux_layers: target layers fused by fc, in HF ``hidden_states`` indices (input of layer i; 0 the embeddings).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_parameters: the target's rotary settings (HF ``rope_parameters``: rope_theta, rope_type, scaling).
        max_position_embeddings: the longest position the rotary embedding is built for.
        norm_before_residual: the layer's residual is ``hidden_norm(h)`` instead of ``h``.
        norm_before_fc: one RMSNorm (``input_norm``) over the concatenated target states before ``fc``.
        fc_norm: one RMSNorm per target state (``fc_norm.{j}``) before the concatenation (EAGLE-3.1); exclusive with
            ``norm_before_fc``.
        norm_output: the next step is fed ``norm(o)`` instead of ``o``, and ``lm_head`` reads it (EAGLE-3.1).
        window: the sliding window of the drafter's attention, in tokens (trainer/models/documents.py: a query at
            position t sees keys at t - window + 1 .. t), or None for full attention; training-time test and drafting
            apply the same one (:func:`ttt_attention`, :meth:`Eagle3Drafter.forward`).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_theta": 10000.0, "rope_type": "default"})
    max_position_embeddings: int = 4096
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    window: int | None = None

    def __post_init__(self) -> None:
        self.aux_layers = tuple(int(i) for i in self.aux_layers)
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 1):  # fmt: skip
            raise ValueError(f"Eagle3Config.window must be a positive number of tokens or None, got {self.window!r}")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are mutually exclusive (one norm of the concatenation, or one "
                             "per target state)")  # fmt: skip
        if not self.aux_layers:
            raise ValueError("Eagle3Config.aux_layers: at least one target layer is needed")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size={self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_target(
        cls, target_config, draft_vocab_size: int, aux_layers: Sequence[int] | None = None, **flags: bool
    ) -> Eagle3Config:
        """The usual drafter of a target: its widths, heads and rotary settings, one layer; ``flags`` are the norm
        options (:data:`NORM_FLAGS`)."""
        unknown = sorted(set(flags) - set(NORM_FLAGS))
        if unknown:
            raise TypeError(f"unknown norm flags {unknown}; known: {list(NORM_FLAGS)}")
        get = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = get.num_attention_heads
        head_dim = getattr(get, "head_dim", None) or get.hidden_size // heads
        rope = getattr(get, "rope_parameters", None) or {"rope_theta": getattr(get, "rope_theta", 10000.0)}
        rope = {"rope_type": "default", **dict(rope)}
        return cls(
            hidden_size=get.hidden_size,
            intermediate_size=get.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(get, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=get.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=get.hidden_size,
            aux_layers=tuple(aux_layers) if aux_layers else default_aux_layers(get.num_hidden_layers),
            rms_norm_eps=getattr(get, "rms_norm_eps", 1e-6),
            rope_parameters=rope,
            max_position_embeddings=getattr(get, "max_position_embeddings", 4096),
            **{k: bool(v) for k, v in flags.items()},
        )

    def flags(self) -> dict[str, bool]:
        """The norm options, by name (:data:`NORM_FLAGS`)."""
        return {name: bool(getattr(self, name)) for name in NORM_FLAGS}

    def to_dict(self) -> dict:
        out = asdict(self)
        out["aux_layers"] = list(self.aux_layers)
        return out

    def llama_config(self) -> LlamaConfig:
        """The equivalent one-layer Llama config (rotary embedding, and the exports' layer config)."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu",
            tie_word_embeddings=False,
        )


NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


class _Layer(nn.Module):
    """What the drafter's decoder layers share once their modules exist: the projections split into heads and the
    attention output, residual and MLP (``self_attn``, ``post_attention_layernorm``, ``mlp`` and ``config``)."""

    config: Eagle3Config
    self_attn: AttentionProjections
    post_attention_layernorm: RMSNorm
    mlp: GatedMLP

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, S, in] the normed input -> q [B, nh, S, D], k and v [B, nkv, S, D], before the rotary embedding."""
        c = self.config
        B, S, _ = x.shape
        q = self.self_attn.q_proj(x).view(B, S, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.self_attn.k_proj(x).view(B, S, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.self_attn.v_proj(x).view(B, S, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return q, k, v

    def block(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """residual: [B, S, H]; attn: [B, nh, S, D] attention output -> the layer output [B, S, H]."""
        B, _, S, _ = attn.shape
        h = residual + self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, S, -1))  # [B, S, H]
        return h + self.mlp(self.post_attention_layernorm(h))


class MidLayer(_Layer):
    """The EAGLE-3 decoder layer (``midlayer`` in the native format)."""

    def __init__(self, config: Eagle3Config) -> None:
        """
        Args:
            config: the drafter's shape.
        """
        super().__init__()
        self.config = config
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        c = config
        self.self_attn = AttentionProjections(  # q/k/v from the concatenated [embeds; hidden], 2H wide
            2 * c.hidden_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def qkv(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """embeds, hidden: [B, S, H]; cos, sin: [B, S, D] -> q [B, nh, S, D], k and v [B, nkv, S, D] (rotated)."""
        q, k, v = self.project(embeds, hidden)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """embeds, hidden: [B, S, H] -> q [B, nh, S, D], k and v [B, nkv, S, D], before the rotary embedding."""
        return self.heads(torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1))  # in: 2H

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """hidden: [B, S, H] the layer's input features; attn: [B, nh, S, D] attention output -> the layer output
        [B, S, H]. The residual is ``hidden`` (``hidden_norm(hidden)`` with ``norm_before_residual``)."""
        return self.block(self.hidden_norm(hidden) if self.config.norm_before_residual else hidden, attn)


class DecoderLayer(_Layer):
    """A plain Llama decoder layer over the features alone (H wide): the layers after the first of a drafter with
    several (speculators' ``num_layers``, ``layers.1.*`` onwards in its format)."""

    def __init__(self, config: Eagle3Config) -> None:
        """
        Args:
            config: the drafter's shape.
        """
        super().__init__()
        c = config
        self.config = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = AttentionProjections(
            c.hidden_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)

    def qkv(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden: [B, S, H]; cos, sin: [B, S, D] -> q [B, nh, S, D], k and v [B, nkv, S, D] (rotated)."""
        q, k, v = self.heads(self.input_layernorm(hidden))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """hidden: [B, S, H] the layer's input; attn: [B, nh, S, D] -> the layer output [B, S, H]."""
        return self.block(hidden, attn)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q: [B, nh, N, D]; k, v: [B, nkv, M, D]; allowed: [N, M] or [B, 1, N, M] bool -> [B, nh, N, D]."""
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=allowed)


def causal_after(n: int, m: int, device: torch.device | str) -> torch.Tensor:
    """[n, m + n] bool: ``n`` new elements each see all ``m`` cached ones and the new ones up to themselves."""
    return torch.ones(n, m + n, dtype=torch.bool, device=device).tril(m)


def windowed(
    allowed: torch.Tensor,
    window: int | None,
    positions: torch.Tensor,
    past_len: int,
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """``allowed`` with the keys further than ``window`` behind each query masked (trainer/models/documents.py's
    convention).

    Args:
        allowed: [N, M + N] or [B, 1, N, M + N] bool over past then new keys.
        window: the sliding window, or None (``allowed`` returned as it is).
        positions: [B, N] the queries' rotary positions.
        past_len: M, the cached keys.
        key_positions: [M + N] the keys' rotary positions; None: the past at 0..M-1, the new keys at ``positions``.

    Returns:
        [B, 1, N, M + N] bool (``allowed`` itself without a window).
    """
    if window is None:
        return allowed
    if key_positions is None:
        past = torch.arange(past_len, device=positions.device).expand(positions.shape[0], past_len)  # [B, M]
        key_positions = torch.cat([past, positions], dim=1)  # [B, M + N]
    inside = (positions[:, :, None] - key_positions[..., None, :]) < window  # [B, N, M + N]
    return allowed & inside[:, None]


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: tuple[torch.Tensor, torch.Tensor] | None,
    allowed: torch.Tensor,
) -> torch.Tensor:
    """Drafting attention of new elements over a cache and themselves. q: [B, nh, N, D]; k, v: [B, nkv, N, D] the new
    elements'; past: cached (k, v), each [B, nkv, M, D], or None; allowed: [N, M + N] (or [B, 1, N, M + N]) bool over
    past then new keys -> [B, nh, N, D]."""
    keys = k if past is None else torch.cat([past[0], k], dim=2)  # [B, nkv, M + N, D]
    values = v if past is None else torch.cat([past[1], v], dim=2)
    return masked_attention(q, keys, values, allowed)


def ttt_attention(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    impl: Impl = "dense",
    window: int | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of training-time-test step ``i = len(keys) - 1`` without building the ``[S, (i + 1) S]`` mask.

    Query ``t`` sees the step-0 keys ``0..t`` (causal) and, for every later step ``j = 1..i``, only the key at its
    own position ``t``. q: [B, nh, S, D]; keys[j], values[j]: [B, nkv, S, D] -> [B, nh, S, D].

    ``window`` (trainer/models/documents.py's convention, by rotary position): query ``t`` of step ``i`` sits at
    position ``t + i``, the step-0 key ``p`` at ``p`` and the step-``j`` key at ``t + j``, so it keeps the step-0 keys
    with ``t + i - p < window`` and the step-``j`` keys with ``i - j < window``: what drafting depth ``i`` after
    position ``t`` sees (its cache and its ancestors, proposer.py). ``documents`` [B, S]: step-0 keys of another
    document are masked (the later steps' keys are the query's own element).

    ``impl``: ``dense`` computes the causal scores [S, S] and the i diagonal ones [S, i] and normalises them together;
    ``flex`` runs the same mask through flex attention (trainer/models/block_attention.py: fused, no probabilities
    stored; CUDA only for training); ``auto`` picks flex on CUDA.
    """
    if _resolved(impl, q) == "flex":
        return ttt_flex_attention(q, list(keys), list(values), window, documents)
    groups = q.shape[1] // keys[0].shape[1]
    S, i = q.shape[2], len(keys) - 1
    scale = 1.0 / math.sqrt(q.shape[-1])
    k0, v0 = repeat_kv(keys[0], groups), repeat_kv(values[0], groups)  # [B, nh, S, D]
    index = torch.arange(S, device=q.device)  # [S]
    # causal by element, the window by position: query t (position t + i) keeps p <= t with t - p < window - i
    allowed = allowed_keys(index, index, documents, documents, None if window is None else window - i)  # [(B,) S, S]
    allowed = allowed if allowed.dim() == 2 else allowed[:, None]  # [S, S] or [B, 1, S, S]
    skip = 0 if window is None else max(0, i - window)  # steps 1..skip fall outside the window (j > i - window kept)
    scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))]  # [B, nh, S, S]
    for k in keys[1 + skip :]:
        scores.append((q * repeat_kv(k, groups)).sum(-1, keepdim=True) * scale)  # [B, nh, S, 1]
    probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)  # [B, nh, S, S + kept]
    out = probs[..., :S] @ v0  # [B, nh, S, D]
    for j, v in enumerate(values[1 + skip :]):
        out = out + probs[..., S + j : S + j + 1] * repeat_kv(v, groups)
    return out


def _resolved(impl: Impl, q: torch.Tensor) -> str:
    """The implementation ``impl`` resolves to for queries ``q`` (trainer/models/block_attention.py)."""
    return resolve_impl(impl, q.device, torch.is_grad_enabled() and q.requires_grad)


def ttt_mask(
    seq_len: int,
    step: int,
    device: torch.device | str = "cpu",
    window: int | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mask :func:`ttt_attention` applies, built explicitly: ``[S, (step + 1) S]`` bool (``[B, S, (step + 1) S]``
    with ``documents`` [B, S]) over the keys of steps 0..step concatenated in step order (for tests and reading)."""
    index = torch.arange(seq_len, device=device)  # [S]
    first = allowed_keys(index, index, documents, documents, None if window is None else window - step)  # [(B,) S, S]
    eye = torch.eye(seq_len, dtype=torch.bool, device=device).expand_as(first)  # [..., S, S]
    later = [eye & (window is None or step - j < window) for j in range(1, step + 1)]
    return torch.cat([first, *later], dim=-1)


class Eagle3Drafter(nn.Module):
    """The drafter: ``fc`` fuses target features, ``midlayer`` drafts, ``lm_head`` predicts the reduced vocabulary.

    Buffers ``d2t`` (int64 [draft_vocab]: target id minus draft id) and ``t2d`` (bool [vocab]: target id is in the
    draft vocabulary) are part of the state dict, so the mapping travels with every checkpoint. ``input_norm``
    (``norm_before_fc``) and ``fc_norm`` (``fc_norm``) exist only with their flag, under speculators' names.
    """

    def __init__(self, config: Eagle3Config) -> None:
        """
        Args:
            config: the drafter's shape.
        """
        super().__init__()
        self.config = config
        c = config
        n = len(c.aux_layers)
        self.input_norm = RMSNorm(n * c.target_hidden_size, c.rms_norm_eps) if c.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList([RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(n)]) if c.fc_norm else None
        )
        self.fc = nn.Linear(n * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(c.llama_config())
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    @property
    def num_decoder_layers(self) -> int:
        """The decoder layers: EAGLE-3's one (``midlayer``)."""
        return 1

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the reduced vocabulary (see vocab_map.py)."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab map shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match the drafter's "
                f"{tuple(self.d2t.shape)}, {tuple(self.t2d.shape)}"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_ids(self) -> torch.Tensor:
        """[Vd] the target ids of the draft vocabulary, in draft order."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def to_target_ids(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids (any shape) -> target ids."""
        return draft_tokens + self.d2t[draft_tokens]

    def fuse(self, aux_hidden: Sequence[torch.Tensor]) -> torch.Tensor:
        """aux_hidden: one [..., Ht] per aux layer, in ``config.aux_layers`` order -> fused features [..., H]."""
        if len(aux_hidden) != len(self.config.aux_layers):
            raise ValueError(f"expected {len(self.config.aux_layers)} target hidden states, got {len(aux_hidden)}")
        dtype = self.fc.weight.dtype
        if self.fc_norm is not None:
            aux_hidden = [norm(h.to(dtype)) for norm, h in zip(self.fc_norm, aux_hidden)]  # [..., Ht] each
        x = torch.cat(list(aux_hidden), dim=-1).to(dtype)  # [..., n Ht]
        if self.input_norm is not None:
            x = self.input_norm(x)
        return self.fc(x)

    def rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [B, S] -> cos, sin [B, S, D]."""
        return self.rotary(hidden, positions)

    def outputs(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """out: [..., H] layer output -> (the feature fed to the next step [..., H], draft logits [..., Vd]).

        Without ``norm_output`` the feature is ``out`` and the logits ``lm_head(norm(out))``; with it both read the
        post-norm ``norm(out)`` (EAGLE-3.1)."""
        normed = self.norm(out)  # [..., H]
        return (normed if self.config.norm_output else out), self.lm_head(normed)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
        allowed: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One drafter pass over new elements, attending to ``past`` keys/values and to each other.

        Args:
            embeds: [B, N, H] embeddings of the tokens one ahead of ``hidden``.
            hidden: [B, N, H] fused target features or the drafter's own earlier outputs.
            positions: [B, N] rotary positions.
            past: cached (k, v), each [B, nkv, M, D], or None.
            allowed: [N, M + N] (or [B, 1, N, M + N]) bool over past then new keys; None is causal over the new
                elements after all of ``past``.
            key_positions: [M + N] the rotary positions of the past then new keys, which ``config.window`` reads
                (keys further than the window behind a query are masked); None: the past entries sit at 0..M-1 and
                the new ones at ``positions`` (a cache of committed positions).

        Returns:
            out [B, N, H] (the feature for the next step, post-norm with ``norm_output``), logits [B, N, Vd], and the
            new elements' (k, v).
        """
        cos, sin = self.rope(hidden, positions)
        q, k, v = self.midlayer.qkv(embeds, hidden, cos, sin)  # [B, nh, N, D], [B, nkv, N, D] x2
        past_len = 0 if past is None else past[0].shape[2]
        if allowed is None:
            allowed = causal_after(hidden.shape[1], past_len, hidden.device)
        allowed = windowed(allowed, self.config.window, positions, past_len, key_positions)
        out, logits = self.outputs(self.midlayer.finish(hidden, cached_attention(q, k, v, past, allowed)))
        return out, logits, (k, v)

    def ttt_step(
        self,
        embedding: nn.Module,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        impl: Impl = "dense",
        documents: torch.Tensor | None = None,
        attention: Callable[..., torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One training-time-test step ``i = len(keys)`` over every element of a row.

        Args:
            embedding: the target's (frozen) input embedding.
            hidden: [B, S, H] the step's input features (fused target features at step 0, else the step before's
                outputs).
            tokens: [B, S] the tokens embedded at this step.
            positions: [B, S] rotary positions (the step-0 positions plus i).
            keys, values: the keys and values of steps 0..i-1, each [B, nkv, S, D].
            impl: the TTT attention's implementation (see :func:`ttt_attention`).
            documents: [B, S] the document of every element (trainer/models/documents.py), or None (one document).
            attention: ``attention(q, keys, values, window, documents)`` in place of :func:`ttt_attention` with
                ``impl`` (sequence parallelism: that attention over the whole row, each rank holding a slice of its
                elements; ``documents`` are then the whole row's), or None.

        Returns:
            out [B, S, H] (the next step's features), logits [B, S, Vd], and this step's (k, v).
        """
        embeds = embedding(tokens).to(hidden.dtype)  # [B, S, H]
        cos, sin = self.rope(hidden, positions)
        q, k, v = self.midlayer.qkv(embeds, hidden, cos, sin)
        if attention is None:
            attn = ttt_attention(q, [*keys, k], [*values, v], impl, self.config.window, documents)  # [B, nh, S, D]
        else:
            attn = attention(q, [*keys, k], [*values, v], self.config.window, documents)
        out, logits = self.outputs(self.midlayer.finish(hidden, attn))
        return out, logits, k, v

    def unroll(
        self,
        embedding: nn.Module,
        fused: torch.Tensor,
        next_tokens: torch.Tensor,
        steps: int,
        data_tokens: torch.Tensor | None = None,
        impl: Impl = "dense",
        documents: torch.Tensor | None = None,
    ):
        """Training-time test: yields the draft logits [B, S, Vd] of steps 0..steps-1.

        Args:
            embedding: the target's (frozen) input embedding.
            fused: [B, S, H] fused target features of tokens 0..S-1.
            next_tokens: [B, S] tokens 1..S (token t + 1 for element t).
            steps: unrolled steps K.
            data_tokens: None feeds, at step i > 0, the drafter's own argmax of step i - 1 (mapped to target ids);
                otherwise [B, S + steps] a token stream whose entry ``t + 1 + i`` is fed at step i (the data's
                tokens, as in the reference implementations).
            impl: the TTT attention's implementation (see :func:`ttt_attention`).
            documents: [B, S] the document of every element (trainer/models/documents.py): attention stays inside each
                document and rotary positions count from its first token; None is one document.
        """
        B, S, _ = fused.shape
        base = torch.arange(S, device=fused.device).expand(B, S)  # [B, S]
        if documents is not None:
            base = document_positions(documents)  # [B, S]
        hidden, tokens = fused, next_tokens
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for i in range(steps):
            hidden, logits, k, v = self.ttt_step(embedding, hidden, tokens, base + i, keys, values, impl, documents)
            keys.append(k)
            values.append(v)
            yield logits
            if data_tokens is None:
                tokens = self.to_target_ids(logits.detach().argmax(-1))  # [B, S]
            else:
                tokens = data_tokens[:, i + 2 : i + 2 + S]  # [B, S]


def flag_weights(config: Eagle3Config) -> dict[str, list[str]]:
    """The state-dict names each norm flag adds (flags without weights are absent)."""
    return {
        "norm_before_fc": ["input_norm.weight"],
        "fc_norm": [f"fc_norm.{j}.weight" for j in range(len(config.aux_layers))],
    }


def flag_weight_mismatch(config: Eagle3Config, names: Iterable[str]) -> str | None:
    """Why the weight ``names`` (state-dict names of the drafter) disagree with ``config``'s norm flags, naming the
    flag, or None when they agree."""
    names = set(names)
    for flag, needed in flag_weights(config).items():
        present = [n for n in needed if n in names]
        stray = sorted(n for n in names if n.split(".")[0] == needed[0].split(".")[0] and n not in needed)
        if getattr(config, flag) and (len(present) != len(needed) or stray):
            missing = [n for n in needed if n not in names]
            return f"{flag} is true but the weights {'lack ' + str(missing) if missing else 'hold ' + str(stray)}"
        if not getattr(config, flag) and (present or stray):
            return f"{flag} is false but the weights hold {present + stray} (trained with {flag}: true?)"
    return None
