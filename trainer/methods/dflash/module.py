"""The DFlash drafter: a few non-causal transformer layers that fill a block of mask tokens in one forward pass,
conditioned on the target's hidden states (Chen, Liang and Liu, "DFlash: Block Diffusion for Flash Speculative
Decoding"; the z-lab ``dflash`` package is the reference forward).

A block is ``[anchor, mask x (b - 1)]`` at positions ``p .. p + b - 1``: the anchor is the last committed token and
slot ``k`` predicts the token at ``p + k``. Its input is the target's frozen input embedding of these ids (the raw
embedding rows, as the reference reads them). The context is ``hidden_norm(fc(cat(h_1, ..., h_m)))`` of the target
hidden states of every position before ``p``, computed once and shared by the layers. In every layer, with
``x = input_layernorm(h)`` the block's normalised input:

    Q = q_norm(q_proj(x))                            (per head; RoPE at the slots' positions)
    K = k_norm(k_proj([context; x]))                 (per head; RoPE at the context's and the slots' positions)
    V = v_proj([context; x])
    h = h + o_proj(attention(Q, K, V))               (non-causal: every slot sees the whole context and block)
    h = h + mlp(post_attention_layernorm(h))

That is a ``full_attention`` layer; the objective's ``model.window`` trains non-causal ``sliding_attention`` ones.
Drafters written by speculators' trainer declare their layers ``sliding_attention`` by default (``layer_types`` and
``sliding_window`` of its ``transformer_layer_config``, ``sliding_window_non_causal`` beside it); such a layer of a
block anchored at ``p`` sees the context of positions ``p - sliding_window .. p - 1`` only, and inside the block slot
``k`` sees slots ``0..k`` (causal) unless ``sliding_window_non_causal`` (speculators'
``create_anchor_block_mask_mod``). A layer declared sliding without a window (``sliding_window`` None) is a full one,
as there. :meth:`DFlashDrafter.draft` (the proposer) runs both kinds; :meth:`DFlashDrafter.train_blocks` runs full
layers and non-causal sliding ones.

and the output ``norm(h)`` goes through the target's lm_head (not part of the drafter) on slots 1..b-1. Parameter
names are the z-lab checkpoint's (``layers.{i}.self_attn.{q,k,v,o}_proj``, ``q_norm``, ``k_norm``, ``mlp.*``, the
layer norms, ``fc``, ``hidden_norm``, ``norm``), so that export is the state dict itself.

Target layers are stored in the project's convention, HF ``hidden_states`` indices (``i`` the input of layer ``i``);
the z-lab ``target_layer_ids`` count outputs of layers from 0, so z-lab id ``j`` is index ``j + 1`` here
(``dflash.model.extract_context_feature`` reads ``hidden_states[j + 1]``).

Two uses of one layer stack: :meth:`DFlashDrafter.train_blocks` runs every block of a batch in one pass under the
anchored block-sparse mask (trainer/models/block_attention.py); :meth:`DFlashDrafter.context_kv` and
:meth:`DFlashDrafter.draft` run one block against cached context keys and values, as the proposer does. A test checks
that both give the same slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.activations import ACT2FN
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from trainer.models.block_attention import Impl, anchored_block_attention
from trainer.models.documents import document_positions
from trainer.models.layers import AttentionProjections, GatedMLP, RMSNorm, repeat_kv

KV = tuple[torch.Tensor, torch.Tensor]
FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


def default_target_layers(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """The target layers a DFlash drafter reads by default, in HF ``hidden_states`` indices.

    z-lab's rule, in its own ids (outputs of layers, 0-based): ``round(1 + i * (L - 4) / (count - 1))`` for
    ``i < count``, or ``L // 2`` for one layer; index = id + 1. A target too shallow for that rule to give ``count``
    distinct layers (L - 4 < count - 1) gets ``min(count, L - 1)`` layers spread evenly over the outputs of layers
    0..L-2. The last layer's output is never read: the reference package would take HF's ``hidden_states[L]``, which
    is after the final norm, while the engines capture the residual stream at the input of a layer and have no layer
    L to capture it at (see :class:`DFlashConfig`).
    """
    top = num_layers - 2  # the last z-lab id every reader agrees on
    if top < 0 or count < 1:
        raise ValueError(f"a target of {num_layers} layers has no intermediate layer output for {count} target layers")
    if count == 1:
        ids = [min(num_layers // 2, top)]
    elif num_layers - 4 >= count - 1:
        ids = [round(1 + i * (num_layers - 4) / (count - 1)) for i in range(count)]
    else:
        count = min(count, top + 1)
        ids = [round(i * top / (count - 1)) for i in range(count)] if count > 1 else [top]
    return tuple(i + 1 for i in ids)


def default_gamma(block_size: int) -> float:
    """The loss decay of slot k, exp(-(k - 1) / gamma): 7 at b = 16 and 4 at b = 8 (the published settings), on the
    line through them elsewhere."""
    return 4.0 + (block_size - 8) * 3.0 / 8.0 if block_size >= 8 else max(1.0, block_size / 2.0)


@dataclass
class DFlashConfig:
    """The drafter's shape. Stored in checkpoints (``to_dict``) and translated by the exporters.

    Attributes:
        hidden_size: H, the drafter's width (the target's: ``fc`` maps ``m * H`` to ``H``).
        intermediate_size: the MLP's inner width.
        num_hidden_layers: n, the draft layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention).
        head_dim: width of one head.
        vocab_size: the target's vocabulary (embedding rows).
        target_layers: the m target hidden states read, HF ``hidden_states`` indices (z-lab id + 1) in 1..L-1, in
            ``fc`` order.
        num_target_layers: L, the target's decoder layers.
        block_size: b, slots per block (the anchor and b - 1 drafts).
        mask_token_id: the id whose embedding fills slots 1..b-1 (a row no token of the tokenizer uses).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_parameters: the target's rotary settings (HF ``rope_parameters``).
        max_position_embeddings: the longest position the rotary embedding is built for.
        hidden_act: the MLP's activation.
        layer_types: each draft layer's attention, ``full_attention`` or ``sliding_attention`` (speculators'
            ``transformer_layer_config.layer_types``); None: every layer full.
        sliding_window: the context positions before the anchor a sliding layer sees (speculators'
            ``transformer_layer_config.sliding_window``); None makes a sliding layer a full one.
        sliding_window_non_causal: a sliding layer's slots see the whole block (speculators' top-level key; its
            default, False, makes slot k see slots 0..k).

    A block refiner's config (refiner.py) is a subclass that adds its own fields.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layers: tuple[int, ...]
    num_target_layers: int
    block_size: int = 16
    mask_token_id: int = 0
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_theta": 10000.0, "rope_type": "default"})
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    sliding_window_non_causal: bool = False

    def __post_init__(self) -> None:
        self.target_layers = tuple(int(i) for i in self.target_layers)
        if self.layer_types is not None:
            self.layer_types = tuple(str(t) for t in self.layer_types)
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types={list(self.layer_types)}: {len(self.layer_types)} entries for "
                    f"{self.num_hidden_layers} layers"
                )
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer_types={list(self.layer_types)}: {unknown} not one of {list(LAYER_TYPES)}")
        if self.sliding_window is not None and int(self.sliding_window) < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 (or None: no window)")
        if self.block_size < 2:
            raise ValueError(
                f"block_size={self.block_size}: a block needs the anchor and at least one mask slot (>= 2)"
            )
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers={self.num_hidden_layers}: a drafter needs at least one layer")
        L = self.num_target_layers
        outside = [i for i in self.target_layers if not 1 <= i <= L - 1]
        if not self.target_layers or outside:
            raise ValueError(
                f"target_layers={list(self.target_layers)}: {outside or 'none given'} outside the layer outputs the "
                f"engines read of a {L}-layer target, HF hidden_states 1..{L - 1} (z-lab ids 0..{L - 2}; the last "
                "layer's output is HF's normed hidden_states[L] for the reference package, the pre-norm residual "
                "stream for SGLang and vLLM)"
            )
        if len(set(self.target_layers)) != len(self.target_layers):
            raise ValueError(f"target_layers={list(self.target_layers)} repeats a layer")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the target's {self.vocab_size} embedding rows"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_target(
        cls,
        target_config,
        num_hidden_layers: int,
        target_layers: Sequence[int],
        block_size: int,
        mask_token_id: int,
    ) -> DFlashConfig:
        """The usual drafter of a target: its widths, heads and rotary settings."""
        get = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = get.num_attention_heads
        rope = getattr(get, "rope_parameters", None) or {"rope_theta": getattr(get, "rope_theta", 10000.0)}
        return cls(
            hidden_size=get.hidden_size,
            intermediate_size=get.intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(get, "num_key_value_heads", None) or heads,
            head_dim=getattr(get, "head_dim", None) or get.hidden_size // heads,
            vocab_size=get.vocab_size,
            target_layers=tuple(target_layers),
            num_target_layers=get.num_hidden_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            rms_norm_eps=getattr(get, "rms_norm_eps", 1e-6),
            rope_parameters={"rope_type": "default", **dict(rope)},
            max_position_embeddings=getattr(get, "max_position_embeddings", 4096),
            hidden_act=getattr(get, "hidden_act", "silu"),
        )

    def to_dict(self) -> dict:
        out = asdict(self)
        out["target_layers"] = list(self.target_layers)
        if self.layer_types is not None:
            out["layer_types"] = list(self.layer_types)
        return out

    def windowed(self, layer: int) -> bool:
        """Layer ``layer`` sees a window of the context (a ``sliding_attention`` layer with a ``sliding_window``)."""
        return self.layer_types is not None and self.layer_types[layer] == SLIDING and self.sliding_window is not None

    @property
    def all_full(self) -> bool:
        """Every layer sees the whole context and the whole block (what draftsmith trains)."""
        return not any(self.windowed(i) for i in range(self.num_hidden_layers))

    @property
    def zlab_layer_ids(self) -> list[int]:
        """``target_layers`` as z-lab counts them (outputs of layers, 0-based)."""
        return [i - 1 for i in self.target_layers]

    def qwen3_config(self) -> Qwen3Config:
        """The equivalent Qwen3 config of the draft layers (the z-lab checkpoint's ``config.json`` is one)."""
        return Qwen3Config(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            hidden_act=self.hidden_act,
            attention_bias=False,
            tie_word_embeddings=False,
        )


class DFlashLayer(nn.Module):
    """One draft layer: keys and values over the context and the block, queries from the block only."""

    def __init__(self, config: DFlashConfig) -> None:
        """
        Args:
            config: the drafter's shape.
        """
        super().__init__()
        self.config = config
        c = config
        self.self_attn = AttentionProjections(
            c.hidden_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, ACT2FN[config.hidden_act])
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[B, T, heads * D] -> [B, heads, T, D]."""
        B, T, _ = x.shape
        return x.view(B, T, heads, self.config.head_dim).transpose(1, 2)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """Keys (normed, rotated) and values of normalised inputs x [B, T, H] -> [B, nkv, T, D] each."""
        a, nkv = self.self_attn, self.config.num_key_value_heads
        k = _rope(a.k_norm(self._heads(a.k_proj(x), nkv)), cos, sin)
        return k, self._heads(a.v_proj(x), nkv)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend,
        context: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One layer over the block.

        Args:
            h: [B, Q, H] the block's hidden states.
            cos, sin: [B, Q, D] rotary tables at the slots' positions.
            attend: ``attend(q, k, v, context_kv)`` maps the block's queries [B, nh, Q, D], keys and values
                [B, nkv, Q, D] and the context's (k, v) (or None) to the attention output [B, nh, Q, D].
            context: (context [B, C, H], cos, sin [B, C, D]) whose keys and values this layer projects here, inside
                its own forward (so that a sharded layer's weights are gathered), or None when ``attend`` holds
                cached ones.

        Returns:
            [B, Q, H].
        """
        a = self.self_attn
        x = self.input_layernorm(h)  # [B, Q, H]
        q = _rope(a.q_norm(self._heads(a.q_proj(x), self.config.num_attention_heads)), cos, sin)  # [B, nh, Q, D]
        k, v = self.kv(x, cos, sin)  # [B, nkv, Q, D]
        out = attend(q, k, v, None if context is None else self.kv(*context))  # [B, nh, Q, D]
        B, _, Q, _ = out.shape
        h = h + a.o_proj(out.transpose(1, 2).reshape(B, Q, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, heads, T, D] with cos, sin [B, T, D] (HF's rotate-half convention)."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]


class DFlashDrafter(nn.Module):
    """The drafter: ``fc`` and ``hidden_norm`` make the context, ``layers`` fill the block, ``norm`` ends it.

    A block refiner's drafter (refiner.py) is a subclass that adds its modules after the backbone's, named in
    :attr:`refiner_modules`.
    """

    refiner_modules: tuple[str, ...] = ()
    """The attributes holding a block refiner's modules (their weights are not the backbone's); none here."""

    def __init__(self, config: DFlashConfig) -> None:
        """
        Args:
            config: the drafter's shape.
        """
        super().__init__()
        self.config = config
        c = config
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(c.num_hidden_layers))
        self.fc = nn.Linear(len(c.target_layers) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(c.qwen3_config())  # buffers not persistent: not in the state dict
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def make_layer(self, index: int) -> DFlashLayer:
        """Draft layer ``index`` of ``self.config``: a :class:`DFlashLayer` (a block refiner whose layers differ,
        refiner.py, builds its subclass)."""
        return DFlashLayer(self.config)

    @classmethod
    def is_refiner_weight(cls, name: str) -> bool:
        """The state dict's weight ``name`` is a block refiner's, not the backbone's: under one of
        :attr:`refiner_modules` (a refiner with weights inside the layers names them too); none in DFlash."""
        return name.startswith(tuple(f"{module}." for module in cls.refiner_modules))

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [B, T] -> cos, sin [B, T, D] in x's dtype."""
        return self.rotary(x, positions)

    def context(self, hidden: Sequence[torch.Tensor]) -> torch.Tensor:
        """hidden: one [B, C, H] per target layer, in ``config.target_layers`` order -> the context [B, C, H]."""
        if len(hidden) != len(self.config.target_layers):
            raise ValueError(f"expected {len(self.config.target_layers)} target hidden states, got {len(hidden)}")
        return self.hidden_norm(self.fc(torch.cat(list(hidden), dim=-1).to(self.fc.weight.dtype)))

    def block_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors: [..., N] anchor token ids -> [..., N * b] the blocks' input ids (anchor, then mask ids)."""
        b = self.config.block_size
        ids = torch.full((*anchors.shape, b), self.config.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[..., 0] = anchors
        return ids.flatten(-2)

    def train_blocks(
        self,
        context: torch.Tensor,
        embeds: torch.Tensor,
        anchors: torch.Tensor,
        impl: Impl = "auto",
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every block of a batch in one pass.

        Args:
            context: [B, S, H] the context of positions 0..S-1 (:meth:`context`).
            embeds: [B, N * b] block inputs: the target's embeddings of :meth:`block_ids`, [B, N * b, H].
            anchors: [B, N] the anchor position of every block (its slots sit at anchor .. anchor + b - 1).
            impl: the block-sparse attention's implementation (``auto``: flex on CUDA, dense elsewhere).
            documents: [B, S] the document of every position (trainer/models/documents.py): a block sees its anchor's
                document only and rotary positions count from its first token; None is one document.

        A sliding layer (:meth:`DFlashConfig.windowed`) sees the context ``anchor - sliding_window .. anchor - 1``,
        as :meth:`draft`; its block must be non-causal (``sliding_window_non_causal``, what ``model.window`` sets).

        Returns:
            [B, N * b, H] the normed outputs of every slot (slot 0 of each block included).
        """
        c = self.config
        causal = [i for i in range(c.num_hidden_layers) if c.windowed(i) and not c.sliding_window_non_causal]
        if causal:
            raise ValueError(
                f"layer_types={list(c.layer_types or [])} with sliding_window={c.sliding_window} and "
                "sliding_window_non_causal false: draftsmith trains non-causal blocks only (a drafter read from such "
                "an export drafts)"
            )
        B, S, _ = context.shape
        b = c.block_size
        base = torch.arange(S, device=anchors.device).expand(B, S)  # [B, S]
        first = anchors  # [B, N] the anchors' rotary positions (an anchor may sit past the row, as in drafting)
        if documents is not None:
            offset = base - document_positions(documents)  # [B, S] each position's document start
            base = base - offset
            first = anchors - offset.gather(1, anchors.clamp(max=S - 1))
        positions = (first[:, :, None] + torch.arange(b, device=anchors.device)).flatten(1)  # [B, N * b]
        cos, sin = self.rope(embeds, positions)
        cos_c, sin_c = self.rope(embeds, base)

        h = embeds.to(self.fc.weight.dtype)
        for index, layer in enumerate(self.layers):
            window = c.sliding_window if c.windowed(index) else None

            def attend(q, k, v, context_kv, window=window):
                return anchored_block_attention(q, *context_kv, k, v, anchors, b, impl, window, documents)

            h = layer(h, cos, sin, attend, (context, cos_c, sin_c))
        return self.norm(h)

    def forward(
        self,
        hidden: Sequence[torch.Tensor],
        embeds: torch.Tensor,
        anchors: torch.Tensor,
        impl: Impl = "auto",
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The training pass: :meth:`context` of the target hidden states ([B, S, H] each, in ``target_layers``
        order), then :meth:`train_blocks` (as the module's forward, so that sharding strategies gather ``fc``)."""
        return self.train_blocks(self.context(hidden), embeds, anchors, impl, documents)

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Keys and values of context entries for every layer (the proposer caches them).

        context: [B, C, H] (:meth:`context`); positions: [B, C] -> per layer (k, v), each [B, nkv, C, D].
        """
        cos, sin = self.rope(context, positions)
        return [layer.kv(context, cos, sin) for layer in self.layers]

    def draft(self, embeds: torch.Tensor, positions: torch.Tensor, past: Sequence[KV]) -> torch.Tensor:
        """One block (or several blocks sharing one context) against cached context entries.

        embeds: [B, Q, H] the block's input embeddings; positions: [B, Q]; past: per layer (k, v) [B, nkv, C, D] of
        the context before the block, positions 0..C-1. In a full layer every slot sees all of ``past`` and the whole
        block; in a sliding one (:meth:`DFlashConfig.windowed`, one block only, anchored at ``positions[:, 0]``) the
        context from ``anchor - sliding_window`` on, and slots 0..k of the block unless
        ``sliding_window_non_causal``. Returns [B, Q, H].
        """
        c = self.config
        cos, sin = self.rope(embeds, positions)
        groups = c.num_attention_heads // c.num_key_value_heads
        h = embeds.to(self.fc.weight.dtype)
        for index, (layer, (k_ctx, v_ctx)) in enumerate(zip(self.layers, past)):
            mask = self.window_mask(positions, k_ctx.shape[2]) if c.windowed(index) else None

            def attend(q, k, v, _context_kv, k_ctx=k_ctx, v_ctx=v_ctx, mask=mask):
                keys = repeat_kv(torch.cat([k_ctx, k], dim=2), groups)  # [B, nh, C + Q, D]
                values = repeat_kv(torch.cat([v_ctx, v], dim=2), groups)
                return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

            h = layer(h, cos, sin, attend)
        return self.norm(h)

    def window_mask(self, positions: torch.Tensor, cached: int) -> torch.Tensor:
        """The keys a sliding layer's slots see: [B, 1, Q, C + Q] bool (True: seen) for a block at ``positions``
        [B, Q] (anchor ``positions[:, 0]``) after ``cached`` context entries at positions 0..C-1."""
        c = self.config
        B, Q = positions.shape
        if Q != c.block_size:
            raise ValueError(f"a sliding-window layer drafts one block of {c.block_size} slots at a time, got {Q}")
        anchor = positions[:, :1]  # [B, 1]
        context = torch.arange(cached, device=positions.device)[None]  # [1, C]
        seen = (context >= anchor - c.sliding_window) & (context < anchor)  # [B, C]
        block = torch.ones(Q, Q, dtype=torch.bool, device=positions.device)
        if not c.sliding_window_non_causal:
            block = block.tril()  # slot k sees slots 0..k
        return torch.cat([seen[:, None, :].expand(B, Q, cached), block.expand(B, Q, Q)], dim=-1)[:, None]


def check_mask_token(mask_token_id: int | None, tokenizer, embedding_rows: int) -> int:
    """The mask token id to train with: ``mask_token_id``, or by default the tokenizer's own mask token, else the
    first embedding row past the tokenizer's ids (``len(tokenizer)``, the reference trainer's choice).

    An id the tokenizer uses is refused, naming it: a regular token (text encodes to it) or one of its role tokens
    (bos, eos, pad, unk, sep, cls: the data and the engines use them, and a mask that means "end of text" or "padding"
    silently ruins acceptance). A special token none of these roles names (a reserved token, or a chat-template token
    the data never contains; the objective counts it in the training data) is accepted, since a target whose
    embedding has no row past its tokenizer has nothing else to offer. Without a tokenizer, only the range is checked.
    """
    if tokenizer is None:
        if mask_token_id is None:
            raise ValueError(
                "model.mask_token_id is not set and the target has no tokenizer beside it to choose an unused id from"
            )
        if not 0 <= mask_token_id < embedding_rows:
            raise ValueError(f"model.mask_token_id={mask_token_id} is outside the target's {embedding_rows} rows")
        return mask_token_id
    roles = {}
    for role in ("bos", "eos", "pad", "unk", "sep", "cls"):
        ids = getattr(tokenizer, f"{role}_token_id", None)
        for i in ids if isinstance(ids, list) else [ids]:
            if i is not None:
                roles.setdefault(int(i), role)
    n = len(tokenizer)
    specials = {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
    specials |= {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    if mask_token_id is None:
        own = getattr(tokenizer, "mask_token_id", None)
        if own is not None and int(own) not in roles:
            return int(own)
        if n < embedding_rows:
            return n
        spare = sorted(i for i in specials if i not in roles)
        named = ", ".join(f"{i} {tokenizer.convert_ids_to_tokens(i)!r}" for i in spare[:8]) or "none"
        raise ValueError(
            f"model.mask_token_id is not set and the target's embedding has no row past its tokenizer's {n} tokens: "
            f"set it to a special token the training data never contains (candidates: {named}); never pad or eos"
        )
    if not 0 <= mask_token_id < embedding_rows:
        raise ValueError(f"model.mask_token_id={mask_token_id} is outside the target's {embedding_rows} embedding rows")
    if mask_token_id in roles:
        raise ValueError(
            f"model.mask_token_id={mask_token_id} is the tokenizer's {roles[mask_token_id]} token: the tokenizer uses "
            "it (a mask that means a real token silently ruins acceptance); pick an id the tokenizer does not use"
        )
    if mask_token_id < n and mask_token_id not in specials:
        token = tokenizer.convert_ids_to_tokens(mask_token_id)
        raise ValueError(
            f"model.mask_token_id={mask_token_id} is the token {token!r}, which the tokenizer uses (text encodes to "
            f"it); pick an id the tokenizer does not use: {n} (past its {n} tokens) when the embedding has that row, "
            "or a reserved special token"
        )
    return mask_token_id
