"""Tokenizer helpers: train the project's byte-level BPE, its chat template, and a stable tokenizer hash.

`tokenizer_hash` is the identity used everywhere a teacher and a student must share a vocabulary (teacher shards
record it in their metadata; readers compare it). It hashes the id of every token (regular and added), the BPE
merges (or the model's own table for other tokenizer models) and the special tokens, so two tokenizers with the
same hash map every text to the same ids.

`check_before_reading` lets the model being fitted refuse the data's tokenizer before a datamodule reads or tokenizes
its files.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from typing import Any

from trainer.interface.errors import PathError, UsageError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)

# Roles system / user / assistant. Each turn opens with its role token and a newline. An assistant turn's content and
# its closing EOS sit inside {% generation %} so that `apply_chat_template(..., return_assistant_tokens_mask=True)`
# marks exactly those tokens; other turns close with a newline.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|endoftext|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ message['content'] + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None) -> Any:
    """Train a byte-level BPE `tokenizers.Tokenizer` on `texts` with the project's special tokens.

    Args:
        texts: the training documents.
        vocab_size: the final vocabulary size, special tokens and the 256 byte symbols included.
        length: the number of documents, for the trainer's bookkeeping only.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise UsageError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs more than 256 + specials")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def wrap_fast_tokenizer(tok: Any, model_max_length: int = 1 << 20) -> Any:
    """Wrap a trained `tokenizers.Tokenizer` as a `PreTrainedTokenizerFast` with specials and the chat template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=None,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """Load a tokenizer with `AutoTokenizer`; a local path that does not exist is reported by name."""
    from transformers import AutoTokenizer

    # A hub id is "name" or "org/name"; anything else that does not exist is a missing local path.
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not os.path.exists(os.path.expanduser(name_or_path)):
        raise PathError(f"tokenizer not found: {name_or_path}", "name a tokenizer folder or a hub id")
    return AutoTokenizer.from_pretrained(os.path.expanduser(name_or_path), trust_remote_code=trust_remote_code)


def _backend_json(tokenizer: Any) -> dict[str, Any] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "to_str"):
        backend = tokenizer
    if backend is None:
        return None
    return json.loads(backend.to_str())


def tokenizer_hash(tokenizer: Any) -> str:
    """A stable sha256 hex digest of a tokenizer's vocabulary, merges and special tokens.

    Args:
        tokenizer: a `transformers` tokenizer, a `tokenizers.Tokenizer`, or a path / hub id to load.
    """
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = load_tokenizer(str(tokenizer))
    if hasattr(tokenizer, "get_vocab"):
        vocab = tokenizer.get_vocab()
    else:
        raise TypeError(f"cannot hash a tokenizer of type {type(tokenizer).__name__}: it has no get_vocab()")
    record: dict[str, Any] = {"vocab": sorted((str(k), int(v)) for k, v in vocab.items())}
    backend = _backend_json(tokenizer)
    if backend is not None:
        model = backend.get("model") or {}
        record["model_type"] = model.get("type")
        # BPE merges (list of pairs or "a b" strings depending on the serializer version): normalise to strings.
        merges = model.get("merges")
        if merges is not None:
            record["merges"] = [m if isinstance(m, str) else " ".join(m) for m in merges]
        elif model.get("type") == "Unigram":
            record["unigram"] = model.get("vocab")
        record["added"] = sorted(
            (t["content"], t["id"], bool(t.get("special"))) for t in backend.get("added_tokens", [])
        )
    specials = getattr(tokenizer, "all_special_tokens", None)
    if specials is not None:
        record["special"] = sorted(str(s) for s in specials)
    blob = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def check_before_reading(datamodule: Any) -> None:
    """Runs ``check_data_tokenizer(datamodule)`` of the LightningModule the datamodule's trainer fits, when that
    module defines one (trainer/data/vocab.py ``check_data_tokenizer`` compares the tokenizer files), so that data of
    another tokenizer is refused before the datamodule reads or tokenizes anything: Lightning calls the datamodule's
    ``prepare_data`` and ``setup`` before the module's ``setup``.

    A no-op outside a trainer, or for a module without that method.
    """
    trainer = getattr(datamodule, "trainer", None)
    module = getattr(trainer, "lightning_module", None) if trainer is not None else None
    check = getattr(module, "check_data_tokenizer", None)
    if callable(check):
        check(datamodule)
