"""Fresh Llama configs for models built from scratch (the tiny targets, LayerSkip and MTP-heads pretraining)."""

from __future__ import annotations

from transformers import LlamaConfig


def new_llama_config(tokenizer, overrides: dict, where: str) -> LlamaConfig:
    """A Llama config for a fresh model of ``tokenizer`` (its length is the vocabulary; its special tokens are the
    config's) with ``overrides`` (hidden_size, num_hidden_layers, ...), built in one call so that what derives from
    them (key/value heads, head width) follows; a key Llama configs lack is an error naming ``where``."""
    known = set(LlamaConfig().to_dict())
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{where}: {unknown} are not keys of a Llama config")
    return LlamaConfig(
        **{
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            **overrides,
        }
    )
