"""Sequential multi-token prediction (MTP) modules, DeepSeek-V3 style, on any HF causal LM trunk.

Module ``k`` (0-based here; the k + 1-th of the papers) reads, at index ``i`` of a sequence, the hidden state handed
over by the depth before (the trunk's for module 0) at ``i`` and the embedding of token ``i + k + 1``:

    x = eh_proj(cat([enorm(embed(t[i + k + 1])), hnorm(h[i])]))      # embeddings first, [.., 2H] -> [.., H]
    o = block(x)                                                     # one decoder layer of the trunk's own family
    logits of token i + k + 2 = lm_head(norm(o))                     # a final norm of its own, the shared lm_head

and hands ``o`` (or ``norm(o)``, see ``step_hidden``) to module ``k + 1`` at the same index. The embedding and the
lm_head are always the trunk's (passed in at call time): a module never owns a head or an embedding, so what the
engines do (vLLM replaces the NextN layer's copies with the target's, SGLang ignores them) cannot diverge from what
was trained. The block is the trunk's decoder layer class built for layer ``N + k`` (``N`` the trunk's layers, the
index engines give it): a DeepSeek-V3 trunk gets an MLA block with MoE where the engine builds MoE, a Llama trunk a
Llama layer.

The rotary position of module ``k`` at index ``i`` is ``i + k``: the position of the last token it has read, less one.
Module 0 then sits at the trunk hidden state's own position, as engines place it, and a chain of drafts advances one
position per step whatever module drafts it (vLLM's ``positions += 1``); within one module, relative positions are
those of training.

Engine conventions (:data:`LAYOUTS`), each an explicit field of :class:`MTPConfig`, set per layout and tested against
the export loaders (export.py):

- ``trunk_hidden``: module 0 reads the trunk's last hidden state after its final norm (``after_norm``: what vLLM and
  SGLang feed DeepSeek NextN and Qwen3-Next modules: the target model's output) or before it (``before_norm``).
- ``step_hidden``: what a module hands over: its block output (DeepSeek NextN) or that output after its final norm
  (Qwen3-Next, whose MTP forward returns the normed state).
- ``zero_first_position``: the embedding of the entry at position 0 is zeroed (vLLM and SGLang, DeepSeek NextN and
  MiMo: "masking inputs at position 0, as not needed by MTP").
- ``shared_input``: one ``enorm``, ``hnorm``, ``eh_proj`` and final ``norm`` for all modules (the Qwen3-Next layout
  stores one ``fc``, one pair of input norms and one ``norm``), or one each (DeepSeek's ``M_k``, NextN).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.masking_utils import create_causal_mask

HiddenSide = Literal["after_norm", "before_norm"]


@dataclass(frozen=True)
class Conventions:
    """How an engine runs the modules of one checkpoint layout (see the module docstring)."""

    trunk_hidden: HiddenSide
    step_hidden: HiddenSide
    zero_first_position: bool
    shared_input: bool


LAYOUTS: dict[str, Conventions] = {
    # vLLM DeepSeekMTP / SGLang DeepseekV3ForCausalLMNextN: the target's normed output in, block output handed on,
    # every layer with its own enorm, hnorm, eh_proj and shared_head.norm
    "nextn": Conventions("after_norm", "before_norm", zero_first_position=True, shared_input=False),
    # vLLM Qwen3NextMTP / Qwen3.5: the target's normed output in, the normed output handed on, one fc, pair of input
    # norms and final norm for all layers
    "qwen3_next": Conventions("after_norm", "after_norm", zero_first_position=False, shared_input=True),
}
SHARED_PARTS = ("enorm", "hnorm", "eh_proj", "norm")
"""The parts of a module that ``shared_input`` shares (all but the block)."""
NEXTN_MODEL_TYPES = frozenset({"deepseek_v3"})
"""Model types whose checkpoints store MTP modules as NextN decoder layers (the layout vLLM and SGLang load)."""


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config (the text config of a multimodal model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def default_layout(model_type: str) -> str:
    """``nextn`` for DeepSeek-V3-architecture trunks, the ``mtp.*`` layout of Qwen3-Next / Qwen3.5 otherwise."""
    return "nextn" if model_type in NEXTN_MODEL_TYPES else "qwen3_next"


@dataclass
class MTPConfig:
    """The modules' shape and conventions. Stored in checkpoints (``to_dict``) and rebuilt by every export loader.

    Attributes:
        depth: D, the number of modules.
        trunk: the trunk's HF config as a dict (``model_type`` included): the blocks are its decoder layers.
        layout: the checkpoint layout whose engine conventions the modules follow (a key of :data:`LAYOUTS`).
        trunk_hidden: module 0 reads the trunk's last hidden state ``after_norm`` or ``before_norm`` of its final norm.
        step_hidden: a module hands the next one its block output (``before_norm``) or that output normed.
        zero_first_position: zero the embedding of the entry at position 0.
        shared_input: all modules share module 0's enorm, hnorm, eh_proj and final norm.
        attn_implementation: the blocks' attention implementation (HF ``_attn_implementation``).
    """

    depth: int
    trunk: dict
    layout: str
    trunk_hidden: HiddenSide
    step_hidden: HiddenSide
    zero_first_position: bool
    shared_input: bool = False
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        if int(self.depth) < 1:
            raise ValueError(f"MTP depth (mtp_depth) must be >= 1, got {self.depth}")
        self.depth = int(self.depth)
        if self.layout not in LAYOUTS:
            raise ValueError(f"MTP layout {self.layout!r} is not one of {sorted(LAYOUTS)}")
        for name in ("trunk_hidden", "step_hidden"):
            if getattr(self, name) not in ("after_norm", "before_norm"):
                raise ValueError(f"MTP {name}={getattr(self, name)!r} is not 'after_norm' or 'before_norm'")
        if "model_type" not in self.trunk:
            raise ValueError("MTPConfig.trunk must be an HF config dict with its model_type")

    @classmethod
    def for_trunk(
        cls, trunk_config: PretrainedConfig, depth: int, layout: str = "auto", trunk_hidden: str = "auto"
    ) -> MTPConfig:
        """The modules of a trunk: the layout's conventions, ``auto`` resolved from the trunk's architecture."""
        model_type = text_config(trunk_config).model_type
        layout = default_layout(model_type) if layout == "auto" else layout
        if layout not in LAYOUTS:
            raise ValueError(f"MTP layout {layout!r} is not 'auto' or one of {sorted(LAYOUTS)}")
        conventions = LAYOUTS[layout]
        trunk = trunk_config.to_dict()
        return cls(
            depth=depth,
            trunk=json.loads(json.dumps(trunk, default=str)),
            layout=layout,
            trunk_hidden=conventions.trunk_hidden if trunk_hidden == "auto" else trunk_hidden,  # type: ignore[arg-type]
            step_hidden=conventions.step_hidden,
            zero_first_position=conventions.zero_first_position,
            shared_input=conventions.shared_input,
            attn_implementation=getattr(trunk_config, "_attn_implementation", None) or "sdpa",
        )

    def trunk_config(self) -> PretrainedConfig:
        """The trunk's HF config."""
        data = dict(self.trunk)
        return AutoConfig.for_model(data.pop("model_type"), **data)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TrunkParts:
    """The trunk family's building blocks, found on a skeleton of the trunk built on the meta device."""

    layer: type[nn.Module]
    norm: type[nn.Module]
    rotary: type[nn.Module]
    skeleton: PreTrainedModel


_PARTS: dict[str, TrunkParts] = {}


def trunk_parts(config: PretrainedConfig) -> TrunkParts:
    """The decoder-layer, RMSNorm and rotary classes of a trunk config (cached per config)."""
    key = config.to_json_string()
    if key not in _PARTS:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        decoder = skeleton.get_decoder()
        missing = [n for n in ("layers", "norm", "rotary_emb") if not hasattr(decoder, n)]
        if missing:
            raise ValueError(
                f"a {type(skeleton).__name__} trunk has no decoder {', '.join(missing)}: MTP modules are built from "
                "the trunk's own decoder layer, final norm and rotary embedding"
            )
        _PARTS[key] = TrunkParts(type(decoder.layers[0]), type(decoder.norm), type(decoder.rotary_emb), skeleton)
    return _PARTS[key]


def block_config(config: MTPConfig) -> PretrainedConfig:
    """The trunk's text config for blocks at layers ``N .. N + D - 1``: full attention there (engines build MTP
    blocks as full-attention layers), and the modules' attention implementation."""
    text = copy.deepcopy(text_config(config.trunk_config()))
    n = int(text.num_hidden_layers)
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        text.layer_types = list(layer_types)[:n] + ["full_attention"] * config.depth
    text._attn_implementation = config.attn_implementation
    if hasattr(text, "_experts_implementation") and not text._experts_implementation:
        text._experts_implementation = "eager"  # MoE blocks built outside a model get no implementation otherwise
    return text


class MTPModule(nn.Module):
    """One module: ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], a decoder ``block`` and its final ``norm``."""

    def __init__(self, parts: TrunkParts, config: PretrainedConfig, layer_idx: int) -> None:
        """
        Args:
            parts: the trunk family's classes.
            config: the blocks' config (:func:`block_config`).
            layer_idx: the block's layer index, ``N + k`` (its KV-cache slot, and the engines' index).
        """
        super().__init__()
        hidden, eps = int(config.hidden_size), float(getattr(config, "rms_norm_eps", 1e-6))
        self.enorm = parts.norm(hidden, eps=eps)
        self.hnorm = parts.norm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = parts.layer(config, layer_idx)
        self.norm = parts.norm(hidden, eps=eps)
        self.layer_idx = layer_idx


class MTPModules(nn.Module):
    """D sequential modules and the trunk family's rotary embedding (no embedding, no lm_head of their own)."""

    def __init__(self, config: MTPConfig) -> None:
        """
        Args:
            config: the modules' shape and conventions.
        """
        super().__init__()
        self.config = config
        parts = trunk_parts(config.trunk_config())
        self.block_config = block_config(config)
        self.num_trunk_layers = int(text_config(config.trunk_config()).num_hidden_layers)
        N = self.num_trunk_layers
        self.layers = nn.ModuleList(MTPModule(parts, self.block_config, N + k) for k in range(config.depth))
        self.rotary = parts.rotary(config=self.block_config)
        for module in self.layers.modules():
            parts.skeleton._init_weights(module)  # the family's own initialisation (MoE experts start uninitialised)
        if config.shared_input:
            for layer in self.layers[1:]:
                for name in SHARED_PARTS:
                    setattr(layer, name, getattr(self.layers[0], name))

    @property
    def depth(self) -> int:
        return self.config.depth

    def new_cache(self) -> DynamicCache:
        """A KV cache whose layers ``N .. N + D - 1`` hold the modules' entries (one layer per module)."""
        cache = DynamicCache()
        while len(cache.layers) < self.num_trunk_layers + self.depth:
            cache.layers.append(DynamicLayer())
        return cache

    def run(
        self,
        k: int,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """Module ``k`` over ``n`` new entries, causal over its cached ones and each other.

        Args:
            k: the module (0-based).
            hidden: [B, n, H] the hidden states handed over (the trunk's for k = 0) at the entries' indices.
            embeds: [B, n, H] embeddings of the tokens ``k + 1`` ahead of those indices.
            positions: [B, n] rotary positions (index + k).
            cache: the modules' cache (:meth:`new_cache`), appended to; None for a whole sequence.

        Returns:
            [B, n, H] the block outputs, before the module's final norm.
        """
        layer = self.layers[k]
        dtype = layer.eh_proj.weight.dtype
        embeds = embeds.to(dtype)
        if self.config.zero_first_position:
            embeds = embeds.masked_fill((positions == 0)[..., None], 0.0)
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden.to(dtype))], dim=-1))  # [B, n, H]
        mask = create_causal_mask(
            config=self.block_config,
            inputs_embeds=x,
            attention_mask=None,
            cache=cache,
            position_ids=positions,
            layer_idx=layer.layer_idx,
        )
        rotary = self.rotary(x, position_ids=positions)
        return layer.block(
            x,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=rotary,
        )  # [B, n, H]

    def head_input(self, k: int, out: torch.Tensor) -> torch.Tensor:
        """[.., H] block outputs of module k -> the shared lm_head's input (the module's final norm)."""
        return self.layers[k].norm(out)

    def handoff(self, k: int, out: torch.Tensor) -> torch.Tensor:
        """[.., H] block outputs of module k -> what module k + 1 (or the next draft step) reads."""
        return out if self.config.step_hidden == "before_norm" else self.head_input(k, out)

    def unroll(
        self,
        trunk_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        embedding: Callable[[torch.Tensor], torch.Tensor],
        frozen: int = 0,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Training: every module over whole rows. Yields ``(k, out)`` with out [B, S - k - 1, H], the block outputs
        of module k at indices ``0 .. S - k - 2`` (its labels are the tokens ``k + 2`` ahead: ``labels[:, k + 1:]``).

        Args:
            trunk_hidden: [B, S, H] the trunk's hidden states of ``input_ids`` (the side of ``trunk_hidden``).
            input_ids: [B, S] the rows.
            embedding: the trunk's input embedding.
            frozen: the first this many modules run without gradients (extend mode).
        """
        B, S = input_ids.shape
        hidden = trunk_hidden
        for k in range(self.depth):
            n = S - k - 1
            if n <= 0:
                return
            positions = (torch.arange(n, device=input_ids.device) + k).expand(B, n)  # [B, n]
            with torch.set_grad_enabled(torch.is_grad_enabled() and k >= frozen):
                out = self.run(k, hidden[:, :n], embedding(input_ids[:, k + 1 :]), positions)  # [B, n, H]
            yield k, out
            hidden = self.handoff(k, out)


class MTPDrafter(nn.Module):
    """What a checkpoint of kind ``mtp`` holds: the modules, and the trunk when it was trained with them
    (pre-training; None when the trunk is a frozen model named by the record's target)."""

    def __init__(self, config: MTPConfig, trunk: PreTrainedModel | None = None) -> None:
        """
        Args:
            config: the modules' shape and conventions.
            trunk: the trained trunk (pre-training mode), or None.
        """
        super().__init__()
        self.config = config
        self.mtp = MTPModules(config)
        self.trunk = trunk
