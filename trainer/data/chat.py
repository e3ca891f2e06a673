"""The tokens to train in a chat conversation, under any chat template as its model publishes it.

Published templates (Llama-3.1, Qwen3, Qwen3.5, DeepSeek-V3) carry no ``{% generation %}`` blocks, so transformers'
``return_assistant_tokens_mask`` marks nothing in them. The assistant tokens are found as the field finds them for any
template (speculators' data preprocessing does the same per assistant turn): for assistant turn ``j``, the template
renders the messages before it with the generation prompt (what the model is given), and the messages through it
(what it then writes); the text between the two is trained: the turn's content and the end-of-turn token the
template closes it with (whitespace the template writes after that token is not). The whole conversation is then
tokenized once, and a token is trained when it starts inside a trained span (offsets of a fast tokenizer).

A template whose rendering of the messages before a turn is not a prefix of its rendering through that turn (its
generation prompt is not how it opens an assistant turn) is refused, naming the conversation and the turn. A template
that renders earlier turns differently once a later one follows (Qwen3 writes an empty ``<think>`` block in the last
assistant turn and drops it, with any reasoning, from the earlier ones) gives one row per assistant turn: the
conversation through that turn, as the model sees it when it writes that turn, with that turn alone trained.

A template with ``{% generation %}`` blocks keeps them: transformers' mask is used (trainer/data/text.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainer.interface.errors import DataError, TokenizerError

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_blocks(template: str | None) -> bool:
    """Whether a chat template marks its assistant turns with ``{% generation %}`` blocks."""
    return bool(template) and _GENERATION_BLOCK.search(template) is not None


@dataclass(frozen=True)
class ChatRow:
    """One tokenized conversation (or a conversation cut after one assistant turn) and its trained tokens."""

    ids: list[int]
    trained: list[bool]
    per_turn: bool  # True: one of the rows of a conversation whose template rewrites earlier turns


def _render(tok: Any, messages: Sequence[dict], generation_prompt: bool, where: str) -> str:
    try:
        return tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as err:  # jinja raises its own types (unknown roles, missing keys, raise_exception)
        raise DataError(f"{where}: the chat template failed on this conversation: {err}") from err


def _tokenize(tok: Any, text: str, spans: Sequence[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """Token ids of ``text`` (as ``apply_chat_template`` tokenizes a rendering: no special tokens added) and, for each,
    whether it starts inside one of the character ``spans``."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    trained = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), trained


def assistant_rows(tok: Any, messages: Sequence[dict], where: str) -> list[ChatRow]:
    """The rows of one conversation with its assistant turns trained, as the module docstring says.

    Args:
        tok: a fast tokenizer with a chat template.
        messages: the conversation ({"role", "content"} dicts), with at least one assistant turn.
        where: the record, for errors (``FILE:LINE``).

    Raises:
        DataError: the template fails on the conversation, or its generation prompt does not open an assistant turn
            the way the template renders it.
        TokenizerError: the tokenizer gives no character offsets (a slow tokenizer).
    """
    if not getattr(tok, "is_fast", False):
        raise TokenizerError(
            f"{where}: format='chat' finds the assistant tokens by their character offsets, which only a fast "
            f"tokenizer gives ({type(tok).__name__} is not one)"
        )
    turns: list[tuple[str, int, int]] = []  # (rendering through the turn, trained span start, span end)
    for number, j in enumerate(j for j, m in enumerate(messages) if m.get("role") == "assistant"):
        prompt = _render(tok, messages[:j], True, where) if j else ""
        through = _render(tok, messages[: j + 1], False, where)
        if not through.startswith(prompt):
            cut = next((i for i, (a, b) in enumerate(zip(prompt, through)) if a != b), min(len(prompt), len(through)))
            raise DataError(
                f"{where}: assistant turn {number + 1} (message {j + 1}): the chat template's generation prompt is not "
                f"how it opens that turn (they differ at character {cut}: {prompt[cut : cut + 30]!r} against "
                f"{through[cut : cut + 30]!r}), so its tokens cannot be told from the prompt's",
                hint="use a template whose add_generation_prompt text opens assistant turns, or mark the assistant "
                "turns with {% generation %} blocks",
            )
        end = len(through.rstrip())
        if end > len(prompt):
            turns.append((through, len(prompt), end))
    if not turns:
        return []
    full = _render(tok, messages, False, where)
    if all(full.startswith(through) for through, _, _ in turns):
        ids, trained = _tokenize(tok, full, [(a, b) for _, a, b in turns])
        return [ChatRow(ids, trained, per_turn=False)]
    rows = []
    for through, a, b in turns:
        ids, trained = _tokenize(tok, through, [(a, b)])
        rows.append(ChatRow(ids, trained, per_turn=True))
    return rows
