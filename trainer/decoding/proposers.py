"""Proposers: where the drafts come from. A protocol, a registry, and the proposers that need no training.

A proposer is called once per round with a :class:`ProposalContext` and returns a :class:`DraftTree` (a chain for
most). The engine never looks inside a proposer, so later objectives (Medusa heads, EAGLE-3, DFlash, LayerSkip early
exit, MTP modules) add theirs with ``@register_proposer("name")`` without touching the engine.

Registered proposers build from the ``--drafter`` argument of ``draftsmith eval`` through a classmethod
``from_spec(path, target)``: ``path`` is the drafter's directory (``None`` when the name alone is given) and
``target`` the HF target, for proposers that reuse its embeddings, head or layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from trainer.decoding.cache import new_cache, truncate_cache
from trainer.decoding.tree import DraftTree
from trainer.decoding.verify import probs_from_logits


@dataclass
class ProposalContext:
    """What the engine tells a proposer at the start of a round.

    Attributes:
        tokens: ``[T]`` every committed token (prompt and output). The last one is not yet in the target's cache: it
            is the root of the round's tree.
        k: the most drafts one path may hold this round (already reduced near ``max_new_tokens``); may be 0.
        temperature: 0 for greedy drafting; otherwise draft by sampling at this temperature and return the
            distributions in ``DraftTree.probs``.
        generator: the random generator to sample with (on the target's device), or ``None``.
        vocab_size: the target's vocabulary size; draft tokens and distributions must live in it.
        hidden_states: for proposers that declare ``needs_hidden_states``: layer index (HF ``hidden_states``
            convention: 0 is the embeddings, i the input of layer i, the last the final normed output) to
            ``[n, H]`` target hidden states of the tokens that entered the target's cache in the last forward,
            which are ``tokens[T - 1 - n : T - 1]`` (the whole prompt after prefill, then the root and the accepted
            nodes of the previous round). Empty for other proposers.
    """

    tokens: torch.Tensor
    k: int
    temperature: float = 0.0
    generator: torch.Generator | None = None
    vocab_size: int = 0
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)


@runtime_checkable
class Proposer(Protocol):
    """The drafting side of speculative decoding.

    ``needs_hidden_states``: target hidden-state layers the proposer wants in its context (empty for none).
    ``reset()``: forget any state (a new sequence starts). ``propose(ctx)``: the drafts of one round; no path may be
    deeper than ``ctx.k``.
    """

    needs_hidden_states: tuple[int, ...]

    def reset(self) -> None: ...

    def propose(self, ctx: ProposalContext) -> DraftTree: ...


_REGISTRY: dict[str, type] = {}
P = TypeVar("P", bound=type)


def register_proposer(name: str) -> Callable[[P], P]:
    """Class decorator: make a proposer available to ``draftsmith eval --drafter NAME[:DIR]``."""

    def decorate(cls: P) -> P:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"proposer name {name!r} is already registered by {_REGISTRY[name].__name__}")
        if not callable(getattr(cls, "from_spec", None)):
            raise TypeError(f"proposer {cls.__name__} needs a classmethod from_spec(path, target)")
        _REGISTRY[name] = cls
        return cls

    return decorate


def registered_proposers() -> list[str]:
    """Names of the registered proposers."""
    return sorted(_REGISTRY)


def build_proposer(name: str, path: str | None, target: PreTrainedModel) -> Proposer:
    """Build a registered proposer by name.

    Args:
        name: a registered name (see :func:`registered_proposers`).
        path: the drafter's directory, or ``None``.
        target: the HF target model.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown proposer {name!r}; registered: {', '.join(registered_proposers())}")
    return _REGISTRY[name].from_spec(path, target)


@register_proposer("none")
class NoProposer:
    """No drafts: every round is one plain decoding step of the target (the baseline)."""

    needs_hidden_states: tuple[int, ...] = ()

    @classmethod
    def from_spec(cls, path: str | None, target: PreTrainedModel) -> NoProposer:
        """Build from the command line (no arguments)."""
        return cls()

    def reset(self) -> None:
        """Nothing to forget."""

    def propose(self, ctx: ProposalContext) -> DraftTree:
        """The empty tree."""
        return DraftTree.empty(ctx.tokens.device)


@register_proposer("prompt-lookup")
class PromptLookupProposer:
    """Prompt lookup decoding: find the last n-gram earlier in the context and propose what followed it."""

    needs_hidden_states: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        """
        Args:
            max_ngram: longest suffix n-gram searched for (tried first).
            min_ngram: shortest suffix n-gram searched for.
        """
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    @classmethod
    def from_spec(cls, path: str | None, target: PreTrainedModel) -> PromptLookupProposer:
        """Build from the command line (default n-gram sizes)."""
        return cls()

    def reset(self) -> None:
        """Stateless."""

    def propose(self, ctx: ProposalContext) -> DraftTree:
        """Deterministic drafts copied after the most recent earlier match of the longest matching suffix n-gram."""
        tokens = ctx.tokens  # [T]
        length = tokens.numel()
        if ctx.k <= 0:
            return DraftTree.empty(tokens.device)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = tokens[length - n :]  # [n]
            windows = tokens[: length - 1].unfold(0, n, 1)  # [T - n, n]: every earlier n-gram but the suffix
            hits = (windows == suffix).all(dim=1).nonzero().flatten()  # [M]
            if hits.numel():
                start = int(hits[-1]) + n
                drafts = tokens[start : start + ctx.k]  # [<= k]
                if drafts.numel():
                    return DraftTree.chain(drafts.clone())
        return DraftTree.empty(tokens.device)


@register_proposer("draft-model")
class DraftModelProposer:
    """A separate HF causal LM drafting autoregressively, with its own KV cache reused across rounds.

    The proposer remembers which tokens its cache holds; at each round it keeps the longest prefix that agrees with
    the committed tokens, so accepted drafts are not recomputed. Its logits are cut (or padded with -inf) to the
    target's vocabulary.
    """

    needs_hidden_states: tuple[int, ...] = ()

    def __init__(self, model: PreTrainedModel) -> None:
        """
        Args:
            model: the draft model (eval mode is set here; it shares the target's tokenizer).
        """
        self.model = model.eval()
        self.cache = new_cache(model.config)
        self.cached: list[int] = []

    @classmethod
    def from_spec(cls, path: str | None, target: PreTrainedModel) -> DraftModelProposer:
        """Load ``path`` with ``AutoModelForCausalLM`` on the target's device and dtype."""
        if path is None:
            raise ValueError("the draft-model proposer needs a directory: --drafter DIR or --drafter draft-model:DIR")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype)
        return cls(model.to(target.device))

    def reset(self) -> None:
        """Drop the cache."""
        self.cache = new_cache(self.model.config)
        self.cached = []

    def _logits(self, new_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Feed ``[n]`` tokens after the cache; the last position's logits in the target vocabulary: ``[V]``."""
        out = self.model(input_ids=new_tokens[None], cache=self.cache, use_cache=True, logits_to_keep=1)
        self.cache = out.cache if getattr(out, "cache", None) is not None else self.cache
        self.cached.extend(new_tokens.tolist())
        logits = out.logits[0, -1]  # [V_draft]
        if logits.shape[-1] >= vocab_size:
            return logits[:vocab_size]
        pad = logits.new_full((vocab_size - logits.shape[-1],), float("-inf"))
        return torch.cat([logits, pad])  # [V]

    @torch.no_grad()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        """``ctx.k`` drafts, greedy or sampled at ``ctx.temperature``."""
        tokens = ctx.tokens  # [T]
        if ctx.k <= 0:
            return DraftTree.empty(tokens.device)
        committed = tokens.tolist()
        common = 0
        for a, b in zip(self.cached, committed):
            if a != b:
                break
            common += 1
        common = min(common, len(committed) - 1)  # at least one token to feed, for fresh logits
        truncate_cache(self.cache, common)
        del self.cached[common:]
        drafts, probs = [], []
        feed = tokens[common:]  # [T - common]
        for _ in range(ctx.k):
            logits = self._logits(feed, ctx.vocab_size)  # [V]
            if ctx.temperature > 0:
                p = probs_from_logits(logits, ctx.temperature)  # [V]
                token = torch.multinomial(p, 1, generator=ctx.generator)  # [1]
                probs.append(p)
            else:
                token = logits.argmax()[None]  # [1]
            drafts.append(token)
            feed = token
        draft_tokens = torch.cat(drafts)  # [k]
        return DraftTree.chain(draft_tokens, torch.stack(probs) if probs else None)


class OracleProposer:
    """Drafts the continuation of a known reference output (the target's own greedy output): always right.

    Used by the engine-overhead benchmark and the tests; beyond the reference it drafts nothing.
    """

    needs_hidden_states: tuple[int, ...] = ()

    def __init__(self, reference: torch.Tensor, prompt_length: int) -> None:
        """
        Args:
            reference: ``[T]`` the prompt followed by the expected output.
            prompt_length: number of prompt tokens at the start of ``reference``.
        """
        self.reference = reference.flatten()
        self.prompt_length = prompt_length

    def reset(self) -> None:
        """Stateless."""

    def propose(self, ctx: ProposalContext) -> DraftTree:
        """The next ``ctx.k`` reference tokens."""
        start = ctx.tokens.numel()
        return DraftTree.chain(self.reference[start : start + ctx.k].to(ctx.tokens.device))
