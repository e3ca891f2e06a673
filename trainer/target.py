"""The frozen target (teacher) model: any HF ``AutoModelForCausalLM``, in eval mode, without gradients.

Layer indices follow one convention across the project: ``hidden_states[i]`` as HF returns them, the input of decoder
layer ``i`` (index 0 is the embeddings; index ``L``, the last, is the final normed output, as HF returns it). Exporters
translate to each serving engine's own counting.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    """Maps a recipe's dtype name to a torch dtype, with an error naming the value on a typo."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class TargetOutput:
    """What a target forward returns.

    logits: [B, S, V] in the target's dtype.
    hidden_states: the requested layers' hidden states, each [B, S, H], in the order requested.
    cache: the updated KV cache when ``use_cache`` was set, else None.
    """

    logits: torch.Tensor
    hidden_states: list[torch.Tensor]
    cache: object | None


class FrozenTarget(nn.Module):
    """Wraps an HF causal LM so that it can never be trained by accident.

    The wrapped model's parameters have ``requires_grad=False``, the model stays in eval mode whatever ``train()`` is
    called on a parent module, and every forward runs under ``torch.no_grad()``.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model
        self.model.requires_grad_(False)
        self.model.eval()

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, dtype: str = "float32", trust_remote_code: bool = False
    ) -> FrozenTarget:
        """Loads a local directory or hub id. A local path that does not exist is an error naming the path."""
        path = Path(name_or_path).expanduser()
        if path.exists() and not (path / "config.json").is_file():
            raise FileNotFoundError(f"target {name_or_path!r}: no config.json in that directory")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                name_or_path, dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code
            )
        except OSError as err:
            if path.exists():
                raise
            raise FileNotFoundError(
                f"target {name_or_path!r} is not a local directory, and loading it as a hub id failed ({err}); "
                "train or download the target first"
            ) from err
        return cls(model)

    def train(self, mode: bool = True) -> FrozenTarget:
        """Keeps the target in eval mode (no dropout) even when the parent module trains."""
        super().train(False)
        return self

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection, [V, H]."""
        return self.model.get_output_embeddings().weight

    def final_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The normalised last hidden state, [B, S, H]: ``lm_head(final_hidden)`` gives the logits.

        Used by chunked losses, which project to the vocabulary one chunk of positions at a time.
        """
        with torch.no_grad():
            backbone = self.model.get_decoder()
            return backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        hidden_layers: Sequence[int] = (),
        cache: object | None = None,
        use_cache: bool = False,
        position_ids: torch.Tensor | None = None,
    ) -> TargetOutput:
        """input_ids: [B, S]; hidden_layers: indices into HF ``hidden_states`` (0 embeddings, L final normed output)."""
        L = self.num_layers
        for i in hidden_layers:
            if not 0 <= i <= L:
                raise ValueError(f"hidden layer index {i} out of range: the target has hidden_states 0..{L}")
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            output_hidden_states=bool(hidden_layers),
        )
        hidden = [out.hidden_states[i] for i in hidden_layers]  # each [B, S, H]
        return TargetOutput(out.logits, hidden, out.cache if use_cache else None)
