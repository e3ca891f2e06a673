"""The target session: an HF target and its KV cache for one sequence, run one slice of layers at a time.

The engine owns one session per generation and hands it to proposers (``ProposalContext.session``). A session can

- run a forward over new tokens (token ids, or hidden states entering a given layer) through layers
  ``[start, stop)``, appending their keys and values to those layers' caches, with the causal mask or a draft tree's
  ancestor mask and per-node positions;
- return hidden states of chosen layers in HF's ``hidden_states`` indexing (0 the embeddings, ``i`` the input of
  layer ``i``, ``L`` the final normed output) and, as :data:`FINAL_PRENORM`, the last layer's output before the final
  norm (HF does not return it; some MTP modules read it);
- turn hidden states into logits through the model's own final norm and lm_head (early exit);
- commit an accepted path: every layer keeps the committed tokens and the accepted entries, in order.

So a drafter that is part of the target reuses its work: LayerSkip drafts with layers ``[0, E)`` into the same
cache, and the verification runs layers ``[E, L)`` only, from the drafts' hidden states at layer E. Layers may hold
different numbers of uncommitted entries during a round; a forward through ``[start, stop)`` needs every layer of
the slice to hold the same number (checked).

Two ways to run the model. For the decoder families whose forward is "embed, rotary, decoder layers, final norm,
lm_head" with full attention (:data:`SLICEABLE_MODEL_TYPES`), the session runs that loop itself, calling HF's own
layers, rotary embedding and mask builder, so slices are possible and a full forward is the model's forward. Any other
HF causal LM runs through its own ``forward`` (full passes only; a slice is refused with the reason).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask

from trainer.decoding.cache import compact_cache, new_cache
from trainer.interface.errors import ModelFolderError

FINAL_PRENORM = -1
"""Hidden-state key of the last layer's output before the final norm (HF's ``hidden_states[L]`` is after it)."""

SLICEABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "deepseek_v3", "gemma"})
"""Model types whose decoder forward is embed -> rotary -> layers -> norm with full attention (checked against HF's
own forward by tests/unit/test_decoding_session.py)."""


def slice_refusal(model: PreTrainedModel) -> str | None:
    """Why the session cannot run this model's layers one slice at a time, or None when it can."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SLICEABLE_MODEL_TYPES:
        return (
            f"model type {model_type!r} is not one whose layers the session runs itself "
            f"({', '.join(sorted(SLICEABLE_MODEL_TYPES))})"
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if sliding or any(t != "full_attention" for t in layer_types):
        return f"model type {model_type!r} with sliding-window attention layers"
    decoder = model.get_decoder()
    missing = [n for n in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(decoder, n)]
    if missing or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} lacks {', '.join(missing or ['lm_head'])}"
    return None


RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv")
"""``layer_types`` whose cache is a recurrent state rather than one entry per position."""


def check_rollback(config) -> None:
    """Refuses a target with recurrent layers (Qwen3.5's and Qwen3-Next's linear attention, Mamba): the engine takes a
    rejected draft back by cutting every layer's cache to the accepted prefix, which a recurrent state, updated in
    place, cannot be; such a target needs its state saved before each verification, which the engine does not do."""
    types = list(getattr(config, "layer_types", None) or [])
    recurrent = sorted({t for t in types if t in RECURRENT_LAYER_TYPES})
    if recurrent:
        first = next(i for i, t in enumerate(types) if t in RECURRENT_LAYER_TYPES)
        raise ModelFolderError(
            f"the target's layer_types hold {', '.join(recurrent)} layers (layer {first} first, model_type "
            f"{getattr(config, 'model_type', '?')!r}): speculative decoding takes rejected drafts back by cutting the "
            "cache, which a recurrent state cannot be; draftsmith's engine does not draft for such targets yet"
        )


@dataclass
class SessionOutput:
    """What :meth:`TargetSession.forward` returns.

    Attributes:
        hidden: ``[n, H]`` output of the last layer run (before the final norm).
        layers: requested hidden states, HF index (or :data:`FINAL_PRENORM`) -> ``[n, H]``.
        logits: ``[r, V]`` logits of the last ``r`` rows when ``logits_rows = r`` and the slice ends at the last
            layer, else None.
    """

    hidden: torch.Tensor | None
    layers: dict[int, torch.Tensor] = field(default_factory=dict)
    logits: torch.Tensor | None = None


class TargetSession:
    """An HF causal LM with its KV cache for one sequence (batch size 1), in eval mode, without gradients."""

    def __init__(self, model: PreTrainedModel, sliced: bool | None = None) -> None:
        """
        Args:
            model: the target, an HF causal LM.
            sliced: run the layer loop here (True), through the model's own forward (False), or the former when the
                model's family allows it (None).
        """
        self.model = model
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        self.num_layers = int(config.num_hidden_layers)
        check_rollback(config)
        self.refusal = slice_refusal(model)
        if sliced and self.refusal is not None:
            raise ValueError(f"the target's layers cannot be run one slice at a time: {self.refusal}")
        self.sliced = self.refusal is None if sliced is None else sliced
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.cache = new_cache(model.config)
        self.committed = 0

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def reset(self) -> None:
        """A new sequence: an empty cache."""
        self.cache = new_cache(self.model.config)
        self.committed = 0

    def layer_length(self, layer: int) -> int:
        """Entries (committed and not) in the cache of decoder layer ``layer``."""
        return int(self.cache.get_seq_length(layer))

    def _check_slice(self, start: int, stop: int) -> int:
        """The common cache length of layers [start, stop), or an error."""
        L = self.num_layers
        if not 0 <= start < stop <= L:
            raise ValueError(f"layer slice [{start}, {stop}) is outside the target's layers [0, {L})")
        if (start, stop) != (0, L) and not self.sliced:
            raise ValueError(f"the target's layers cannot be run one slice at a time: {self.refusal}")
        lengths = {self.layer_length(i) for i in range(start, stop)}
        if len(lengths) != 1:
            raise ValueError(f"layers [{start}, {stop}) hold different numbers of cache entries: {sorted(lengths)}")
        return lengths.pop()

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        start: int = 0,
        stop: int | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        layers: tuple[int, ...] = (),
        logits_rows: int = 0,
    ) -> SessionOutput:
        """Run ``n`` new tokens through layers ``[start, stop)``, appending them to those layers' caches.

        Args:
            input_ids: ``[n]`` token ids (``start`` must be 0), or None with ``hidden``.
            hidden: ``[n, H]`` hidden states entering layer ``start``.
            start: first layer run.
            stop: one past the last layer run (default: all layers).
            position_ids: ``[1, n]`` positions; default: the slice's cache length plus 0..n-1.
            attention_mask: ``[1, 1, n, C + n]`` additive mask over the slice's C cached entries and the new ones
                (a draft tree's, see DraftTree.attention_mask); default: causal.
            layers: hidden states to return (HF indices within ``[start, stop]``, or FINAL_PRENORM with stop = L).
            logits_rows: with ``stop`` the last layer, the logits of the last this many rows.
        """
        L = self.num_layers
        stop = L if stop is None else stop
        if (input_ids is None) == (hidden is None):
            raise ValueError("pass exactly one of input_ids and hidden")
        if input_ids is not None and start != 0:
            raise ValueError(f"token ids enter at layer 0, not {start}: pass the hidden states entering it")
        past = self._check_slice(start, stop)
        for i in layers:
            ok = start <= i <= stop or (i == FINAL_PRENORM and stop == L)
            if not ok:
                raise ValueError(f"hidden state {i} is not produced by layers [{start}, {stop})")
        if logits_rows and stop != L:
            raise ValueError(f"logits need the last layer; the slice stops at {stop}")
        if not self.sliced:
            return self._hf_forward(input_ids, position_ids, attention_mask, layers, logits_rows)
        decoder = self.model.get_decoder()
        h = decoder.embed_tokens(input_ids[None]) if input_ids is not None else hidden[None].to(self.dtype)  # [1, n, H]
        n = h.shape[1]
        if position_ids is None:
            position_ids = (past + torch.arange(n, device=h.device))[None]  # [1, n]
        if attention_mask is None:
            attention_mask = create_causal_mask(
                config=decoder.config,
                inputs_embeds=h,
                attention_mask=None,
                cache=self.cache,
                position_ids=position_ids,
                layer_idx=start,
            )
        rotary = decoder.rotary_emb(h, position_ids=position_ids)
        out: dict[int, torch.Tensor] = {start: h[0]} if start in layers else {}
        for i in range(start, stop):
            h = decoder.layers[i](
                h,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=self.cache,
                use_cache=True,
                position_embeddings=rotary,
            )  # [1, n, H]
            if i + 1 in layers and i + 1 < L:
                out[i + 1] = h[0]
        logits = None
        if stop == L:
            if FINAL_PRENORM in layers:
                out[FINAL_PRENORM] = h[0]
            normed = decoder.norm(h)  # [1, n, H]
            if L in layers:
                out[L] = normed[0]
            if logits_rows:
                logits = self.model.lm_head(normed[:, -logits_rows:])[0]  # [r, V]
        return SessionOutput(hidden=h[0], layers=out, logits=logits)

    def _hf_forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        layers: tuple[int, ...],
        logits_rows: int,
    ) -> SessionOutput:
        """A full pass through the model's own forward (families the session does not slice)."""
        if FINAL_PRENORM in layers:
            raise ValueError(f"the pre-norm final hidden state needs a sliceable target: {self.refusal}")
        out = self.model(
            input_ids=input_ids[None],
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=bool(layers),
            logits_to_keep=max(1, logits_rows),
        )
        hidden = {i: out.hidden_states[i][0] for i in layers}  # each [n, H]
        return SessionOutput(hidden=None, layers=hidden, logits=out.logits[0] if logits_rows else None)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` hidden states before the final norm -> ``[n, V]`` logits through the final norm and lm_head."""
        if not self.sliced:
            raise ValueError(f"early exit needs a target whose layers the session runs: {self.refusal}")
        decoder = self.model.get_decoder()
        return self.model.lm_head(decoder.norm(hidden[None].to(self.dtype)))[0]

    def commit(self, keep: torch.Tensor) -> None:
        """Keep the committed tokens and the round's entries at offsets ``keep`` (``[n]``, increasing, relative to
        the committed length) in every layer; they become committed."""
        compact_cache(self.cache, self.committed, keep)
        self.committed += int(keep.numel())
