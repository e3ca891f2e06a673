"""Proposers: where the drafts come from. A protocol, the registry of drafters without weights, and the proposers
that need no training.

A proposer is called once per round with a :class:`ProposalContext` and returns a :class:`DraftTree` (a chain for most).
The engine never looks inside a proposer: what ``draftsmith eval`` and the training callback ask of one (the most drafts
per round, whether it can draft K, writing a tree measured on prompts) is part of the protocol, with its defaults in
:class:`BaseProposer`, which every proposer here and in the methods derives from. Trained drafters get theirs from their
drafter kind (trainer/training/registry.py: ``draftsmith eval --drafter PATH`` loads the drafter and asks its kind, with
the :class:`~trainer.decoding.options.ProposerOptions`); drafters that need no weights register a name here with
``@register_proposer("name")`` and a classmethod ``from_options(target, options)`` (``draftsmith eval --drafter NAME``):
``none``, ``prompt-lookup`` and ``early-exit`` (the target's own first layers, trainer/methods/layerskip/proposer.py).

Dynamic draft length (``ProposerOptions.accept_threshold``, ``draftsmith eval --accept_threshold``). A proposer that
can predict whether its drafts will be accepted declares ``estimates_acceptance = True`` (the hook; ``False`` in
:class:`BaseProposer`) and then, whenever ``ctx.accept_threshold > 0``:

- gives every node of its tree a ``confidence`` (``DraftTree.confidence``, ``[N]``): its predicted probability of
  being accepted given that its parent is. The product along a path is the predicted acceptance of the whole path;
  the engine keeps the nodes whose path product is at least the threshold (:meth:`DraftTree.cut`: a chain stops,
  a tree is pruned). A sampled draft's confidence must not depend on the token drawn for it (take it from the
  distribution, e.g. its top probability): the draft's presence then tells nothing about its value, and speculative
  sampling stays exact;
- may stop drafting early, where its cost is (a sequential drafter's next forward): :class:`ChainCut` keeps the running
  product and says when to stop; what it stops is what the engine would have cut.

The estimate the built-in drafters use is the drafter's own probability, at temperature 1, of the token it drafts
(greedy, and each node of a tree of top-k candidates); for a sampled draft, the top probability of its distribution,
whatever was drawn (:func:`draft_confidence`): EAGLE-2's observation that a drafter's confidence tracks its acceptance
rate, with the cumulative product of the path as the path's estimate. A drafter with a better estimate (a trained
confidence head) sets the same field from it. With ``accept_threshold`` 0 (the default) nothing is estimated and
drafting is as before; a threshold given to a proposer that does not estimate is refused by the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

import torch
from transformers import PreTrainedModel

from trainer.decoding.options import ProposerOptions
from trainer.decoding.session import TargetSession
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
            nodes of the previous round). Empty for other proposers. ``FINAL_PRENORM`` (-1) names the last layer's
            output before the final norm.
        session: the target session (its model, its cache, forwards through a slice of layers), for proposers that
            draft with the target's own layers; the cache holds the committed tokens before the round's pending ones.
        accept_threshold: dynamic draft length: 0 (off), or the least predicted acceptance of a path worth drafting
            and verifying (see the module docstring); only proposers with ``estimates_acceptance`` get one above 0.
    """

    tokens: torch.Tensor
    k: int
    temperature: float = 0.0
    generator: torch.Generator | None = None
    vocab_size: int = 0
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    session: TargetSession | None = None
    accept_threshold: float = 0.0


@runtime_checkable
class Proposer(Protocol):
    """The drafting side of speculative decoding.

    ``needs_hidden_states``: target hidden-state layers the proposer wants in its context (empty for none).
    ``max_drafts``: the most drafts one round can hold (heads, a diffusion block), None when unbounded.
    ``reset()``: forget any state (a new sequence starts). ``propose(ctx)``: the drafts of one round; no path may be
    deeper than ``ctx.k``. ``check_k(k)``: refuse, before any decoding, ``k`` drafts per round that the proposer
    cannot draft (a ValueError naming ``--k``). ``write_tree(path, target, prompts, max_new_tokens, nodes)``: measure
    the proposer on the prompts and write the best tree of ``nodes`` paths to a file ``--tree_choices`` reads (parallel
    heads; others refuse). ``estimates_acceptance``: whether ``propose`` honours ``ctx.accept_threshold`` by giving its
    tree a ``confidence`` (dynamic draft length, see the module docstring). :class:`BaseProposer` holds the defaults
    of all but ``propose``.
    """

    needs_hidden_states: tuple[int, ...]
    max_drafts: int | None
    estimates_acceptance: bool

    def reset(self) -> None: ...

    def propose(self, ctx: ProposalContext) -> DraftTree: ...

    def check_k(self, k: int) -> None: ...

    def write_tree(
        self, path: Path, target: PreTrainedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, nodes: int
    ) -> tuple[tuple[int, ...], ...]: ...


class BaseProposer:
    """The defaults of the :class:`Proposer` protocol, in one place: no hidden states, no bound on the drafts per
    round, no state to forget, any ``k`` up to ``max_drafts``, no tree to write, and no acceptance estimate (set
    ``estimates_acceptance = True`` in a proposer that fills ``DraftTree.confidence`` when ``ctx.accept_threshold >
    0``)."""

    needs_hidden_states: tuple[int, ...] = ()
    max_drafts: int | None = None
    estimates_acceptance: bool = False

    def reset(self) -> None:
        """Stateless by default."""

    def propose(self, ctx: ProposalContext) -> DraftTree:
        """The drafts of one round (every proposer gives its own)."""
        raise NotImplementedError

    def check_k(self, k: int) -> None:
        """Refuse more drafts per round than ``max_drafts``."""
        if self.max_drafts is not None and k > self.max_drafts:
            raise ValueError(f"--k {k}: this drafter drafts at most {self.max_drafts} tokens per round")

    def write_tree(
        self, path: Path, target: PreTrainedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, nodes: int
    ) -> tuple[tuple[int, ...], ...]:
        """Refused: only drafters with parallel heads build a tree from measured accuracies."""
        raise ValueError(f"--write_tree: a {type(self).__name__} does not draft with parallel heads")


def draw(logits: torch.Tensor, ctx: ProposalContext) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The next draft from ``[V]`` logits: ``([1] token, None)`` greedy, or ``([1] token, [V] the distribution it was
    drawn from)`` at ``ctx.temperature`` (speculative sampling needs it)."""
    if ctx.temperature <= 0:
        return logits.argmax()[None], None
    p = probs_from_logits(logits, ctx.temperature)  # [V]
    return torch.multinomial(p, 1, generator=ctx.generator), p


def draft_confidence(logits: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The built-in acceptance estimate from ``[..., V]`` drafter logits: the probability at temperature 1 of
    ``tokens`` (``[..., r]``: r tokens of every distribution, greedy drafts or top-k candidates) as ``[..., r]``, or
    without tokens the top probability (a sampled draft's estimate, which must not depend on the token drawn) as
    ``[...]``; in float32 (float64 logits: float64)."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(logits.to(dtype), dim=-1)  # [..., V]
    if tokens is None:
        return probs.amax(dim=-1)
    return probs.gather(-1, tokens.to(torch.long))  # [..., r]


class ChainCut:
    """The running predicted acceptance of a chain being drafted, for a sequential drafter that stops drafting when
    it falls under ``ctx.accept_threshold`` (what it stops is what :meth:`DraftTree.cut` would cut)."""

    def __init__(self, threshold: float) -> None:
        """
        Args:
            threshold: ``ctx.accept_threshold`` (0: never stop, and nothing is recorded).
        """
        self.threshold = threshold
        self.product = 1.0
        self.values: list[torch.Tensor] = []  # the confidence of every admitted draft, each [] (a 0-d tensor)

    @property
    def active(self) -> bool:
        """Whether a threshold is set."""
        return self.threshold > 0

    def admit(self, confidence: torch.Tensor) -> bool:
        """Whether a next draft of this (0-d) confidence is still worth drafting; records it when it is."""
        if not self.active:
            return True
        product = self.product * float(confidence)
        if product < self.threshold:
            return False
        self.product = product
        self.values.append(confidence.reshape(()))
        return True

    def confidence(self) -> torch.Tensor | None:
        """``[n]`` the confidence of the admitted drafts, for ``DraftTree.chain(..., confidence=...)`` (None when off
        or when nothing was admitted)."""
        return torch.stack(self.values) if self.active and self.values else None


_REGISTRY: dict[str, type] = {}
P = TypeVar("P", bound=type)


def register_proposer(name: str) -> Callable[[P], P]:
    """Class decorator: make a proposer that needs no weights available to ``draftsmith eval --drafter NAME``."""

    def decorate(cls: P) -> P:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"proposer name {name!r} is already registered by {_REGISTRY[name].__name__}")
        if not callable(getattr(cls, "from_options", None)):
            raise TypeError(f"proposer {cls.__name__} needs a classmethod from_options(target, options)")
        _REGISTRY[name] = cls
        return cls

    return decorate


def registered_proposers() -> list[str]:
    """Names of the registered proposers."""
    from trainer.training.registry import kinds

    kinds()  # the methods' proposers that need no weights (early-exit) register when their kind is imported
    return sorted(_REGISTRY)


def build_proposer(name: str, target: PreTrainedModel | None, options: ProposerOptions | None = None) -> Proposer:
    """Build a registered proposer by name.

    Args:
        name: a registered name (see :func:`registered_proposers`).
        target: the HF target model.
        options: the drafting options, for the proposers that read them (None: defaults).
    """
    if name not in registered_proposers():
        raise ValueError(f"unknown proposer {name!r}; registered: {', '.join(registered_proposers())}")
    return _REGISTRY[name].from_options(target, options)


@register_proposer("none")
class NoProposer(BaseProposer):
    """No drafts: every round is one plain decoding step of the target (the baseline)."""

    @classmethod
    def from_options(cls, target: PreTrainedModel | None, options: ProposerOptions | None = None) -> NoProposer:
        """Build from the command line (no options)."""
        return cls()

    def propose(self, ctx: ProposalContext) -> DraftTree:
        """The empty tree."""
        return DraftTree.empty(ctx.tokens.device)


@register_proposer("prompt-lookup")
class PromptLookupProposer(BaseProposer):
    """Prompt lookup decoding: find the last n-gram earlier in the context and propose what followed it."""

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
    def from_options(
        cls, target: PreTrainedModel | None, options: ProposerOptions | None = None
    ) -> PromptLookupProposer:
        """Build from the command line (default n-gram sizes)."""
        return cls()

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


class OracleProposer(BaseProposer):
    """Drafts the continuation of a known reference output (the target's own greedy output): always right.

    Used by the engine-overhead benchmark and the tests; beyond the reference it drafts nothing.
    """

    def __init__(self, reference: torch.Tensor, prompt_length: int) -> None:
        """
        Args:
            reference: ``[T]`` the prompt followed by the expected output.
            prompt_length: number of prompt tokens at the start of ``reference``.
        """
        self.reference = reference.flatten()
        self.prompt_length = prompt_length

    def propose(self, ctx: ProposalContext) -> DraftTree:
        """The next ``ctx.k`` reference tokens."""
        start = ctx.tokens.numel()
        return DraftTree.chain(self.reference[start : start + ctx.k].to(ctx.tokens.device))
