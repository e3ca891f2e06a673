"""Measuring by context length (``draftsmith eval --context_lengths 256,1024,2048``): prompts cut from long documents.

For each context length L, a bucket holds the first L tokens of every document at least L + ``max_new_tokens`` tokens
long, in the file's order (documents too short for a bucket are skipped for it; ``max_prompts`` keeps the first N of
each bucket). The documents are the lines of a prompts file as :func:`trainer.decoding.evaluate.load_prompts` reads them
(a ``text`` or ``prompt`` string, chat ``messages`` or ``input_ids``), tokenized whole. A length the target's context
cannot hold beside the output budget, and a bucket no document fills, are refused before anything is decoded.

The buckets are decoded together, bucket after bucket (:func:`flatten`);
:func:`trainer.decoding.evaluate.evaluate_drafter` splits its statistics by bucket (``by_context`` of the report), and
:func:`target_loss_by_context` gives the target's own next-token loss on each bucket's prompts, so a drafter is not
blamed for its target.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel

from trainer.decoding.drift import prompt_loss
from trainer.interface.errors import DataError, UsageError


def cut_buckets(
    documents: Sequence[Sequence[int]],
    lengths: Sequence[int],
    max_new_tokens: int,
    max_length: int | None = None,
    max_prompts: int = 0,
    source: str = "the documents",
    lengths_key: str = "--context_lengths",
    budget_key: str = "--max_new_tokens",
) -> dict[int, list[list[int]]]:
    """The prompts of every context length: the first L tokens of every document of at least L + ``max_new_tokens``
    tokens, in the documents' order.

    Args:
        documents: token ids of each document (whole).
        lengths: the context lengths (tokens per prompt); returned sorted, each once.
        max_new_tokens: the output budget: a document must hold it after the prompt.
        max_length: the longest prompt the target's context leaves beside the output budget (None: no limit).
        max_prompts: keep the first this many prompts of each bucket (0: all).
        source: what the documents are (a file name), for the refusals.
        lengths_key: how the refusals name the lengths (eval's flag; a recipe key elsewhere).
        budget_key: how the refusals name the output budget.

    Raises:
        UsageError: a length over ``max_length``, naming both.
        DataError: a length no document is long enough for, naming it and the longest document.
    """
    buckets: dict[int, list[list[int]]] = {}
    for length in sorted(set(lengths)):
        if length < 1:
            raise UsageError(f"{lengths_key} {length}: a context length must be at least 1 token")
        if max_length is not None and length > max_length:
            raise UsageError(
                f"{lengths_key} {length}: longer than the {max_length} tokens the target's context "
                f"(max_position_embeddings {max_length + max_new_tokens}) leaves beside "
                f"{budget_key} {max_new_tokens}",
                hint=f"give shorter lengths, lower {budget_key}, or measure a target with a longer "
                "max_position_embeddings",
            )
        bucket = [list(doc[:length]) for doc in documents if len(doc) >= length + max_new_tokens]
        if not bucket:
            longest = max((len(doc) for doc in documents), default=0)
            raise DataError(
                f"{lengths_key} {length}: no document of {source} has the {length + max_new_tokens} tokens a "
                f"{length}-token prompt and {budget_key} {max_new_tokens} need (the longest has {longest})",
                hint="give shorter lengths or a file of longer documents",
            )
        buckets[length] = bucket[:max_prompts] if max_prompts > 0 else bucket
    return buckets


def flatten(buckets: dict[int, list[list[int]]]) -> tuple[list[list[int]], dict[int, list[int]]]:
    """Every bucket's prompts in one list, bucket after bucket, and each bucket's indices into it."""
    prompts: list[list[int]] = []
    indices: dict[int, list[int]] = {}
    for length, bucket in buckets.items():
        indices[length] = list(range(len(prompts), len(prompts) + len(bucket)))
        prompts += bucket
    return prompts, indices


def target_loss_by_context(target: PreTrainedModel, buckets: dict[int, list[list[int]]]) -> dict[int, dict]:
    """The target's mean next-token cross entropy (nats per token, teacher forced) over each bucket's prompts, every
    token after a prompt's first scored: ``{length: {"target_loss", "target_loss_tokens"}}``."""
    out = {}
    for length, bucket in buckets.items():
        loss, tokens = prompt_loss(target, bucket)
        out[length] = {"target_loss": loss, "target_loss_tokens": tokens}
    return out
