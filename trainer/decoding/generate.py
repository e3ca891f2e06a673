"""The speculative decoding engine: one sequence, an HF target with a KV cache, any proposer, chains or trees.

Each round, the proposer drafts a tree (a chain for most proposers) after the committed tokens; the target runs one
forward pass over the root (the last committed token, not yet in its cache) and every draft node, with an
ancestor-only mask for trees; the acceptance rule keeps the longest accepted path and picks the next token; the
target's cache keeps the root and the accepted nodes only. With the empty tree (:class:`NoProposer`) a round is one
plain decoding step, so the same engine gives the target-only baseline.

The target and its cache live in a :class:`~trainer.decoding.session.TargetSession`, which proposers receive in their
context: a drafter that is part of the target drafts through the session's first layers, and the verification then
starts at the layer the drafts' hidden states reached (``DraftTree.verify_layer``), reusing their cache entries.

Dynamic draft length: with ``accept_threshold`` above 0 the proposer (one that ``estimates_acceptance``) stops its
chain or prunes its tree where the predicted acceptance of a path falls under the threshold, and the engine cuts the
round's tree by the same rule (:meth:`DraftTree.cut`), so every proposer's rounds hold only the paths worth verifying.

Exactness. The rules are exact; the arithmetic is the target's. A forward over K + 1 tokens and K + 1 one-token
forwards compute the same logits up to the last bits of floating point (other kernel shapes, other summation order),
so on a near-tie between the top two logits (a gap of about 1e-6 in float32, far less in float64) the argmax may
differ from plain greedy decoding (in bfloat16 a gap of several hundredths does). The tests use float64 targets,
where this does not occur; ``draftsmith eval`` treats any other difference as an error and names the prompt and
position, and reports a difference on such a near-tie (trainer/decoding/identity.py). One sequence at a time: batched
speculative decoding is not built.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from trainer.decoding.proposers import ProposalContext, Proposer
from trainer.decoding.session import TargetSession
from trainer.decoding.tree import DraftTree
from trainer.decoding.verify import (
    greedy_verify_chain,
    greedy_verify_tree,
    probs_from_logits,
    sampling_verify_chain,
    sampling_verify_tree,
)


@dataclass
class RoundStats:
    """One verification forward of the target.

    Attributes:
        drafted: depth of the draft tree (number of drafts for a chain).
        nodes: number of draft tokens verified.
        accepted: number of drafts accepted (the accepted path's length).
        committed: tokens appended to the output by this round (accepted + 1, less when cut by EOS or the budget).
        start: index in the output of the first token this round committed.
    """

    drafted: int
    nodes: int
    accepted: int
    committed: int
    start: int


@dataclass
class GenerationResult:
    """The output of :func:`speculative_generate`.

    Attributes:
        tokens: the generated tokens (without the prompt).
        rounds: one entry per forward of the target. The first forward is also the prefill: it verifies drafts after
            the prompt, or none for proposers that need the target's hidden states of the prompt first.
        target_forwards: forward passes of the target (``len(rounds)``).
        propose_seconds: wall-clock time spent in the proposer.
        target_seconds: wall-clock time spent in the target's forward passes (prefill included).
        prefill_seconds: the part of ``target_seconds`` spent in the first forward (the prefill).
        total_seconds: wall-clock time of the whole generation.
    """

    tokens: list[int]
    rounds: list[RoundStats] = field(default_factory=list)
    target_forwards: int = 0
    propose_seconds: float = 0.0
    target_seconds: float = 0.0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The target's own next token from ``[V]`` logits: argmax, or a sample at ``temperature``."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = probs_from_logits(logits, temperature)  # [V]
    return int(torch.multinomial(probs, 1, generator=generator)[0])


@dataclass
class VerifyOutput:
    """The outcome of one verification forward.

    Attributes:
        path: accepted nodes of the tree, from the root down.
        token: the target's token after the path (correction or bonus).
        hidden_states: requested layer -> ``[n, H]`` target hidden states of the pending tokens and the accepted
            nodes (the entries the round committed).
    """

    path: list[int]
    token: int
    hidden_states: dict[int, torch.Tensor]


@torch.no_grad()
def verify_round(
    session: TargetSession,
    pending: torch.Tensor,
    tree: DraftTree,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    hidden_layers: tuple[int, ...] = (),
    tree_mask: bool | None = None,
) -> VerifyOutput:
    """Run the target once over the pending tokens and the tree, accept a path, commit only its entries.

    Args:
        session: the target and its cache, holding the committed tokens before ``pending``; updated in place.
        pending: ``[m]`` committed tokens not yet in the cache (the whole prompt in the first round, then the root:
            the last committed token); the drafts continue after the last one.
        tree: the drafts. With ``tree.verify_layer = E > 0`` the forward runs layers ``[E, L)`` only, from
            ``tree.verify_hidden`` (the pending tokens' and nodes' hidden states entering layer E, whose entries in
            layers ``[0, E)`` the proposer already wrote to the session's cache).
        temperature: 0 for greedy verification, otherwise speculative sampling.
        generator: random generator for sampling.
        hidden_layers: target hidden-state layers to return for the kept positions.
        tree_mask: force (True) or skip (False) the explicit ancestor mask and positions; by default they are used
            for trees only, and a chain goes through the causal mask.
    """
    device = session.device
    prefix = session.committed
    m = pending.numel()
    chain = tree.is_chain()
    use_mask = (not chain) if tree_mask is None else tree_mask
    if not use_mask and not chain:
        raise ValueError("a tree that is not a chain needs its ancestor mask")
    mask = tree.attention_mask(prefix, session.dtype, m).to(device) if use_mask else None  # [1, 1, m + N, P + m + N]
    positions = tree.position_ids(prefix, m).to(device) if use_mask else None  # [1, m + N]
    rows = tree.num_nodes + 1
    if tree.verify_layer == 0:
        inputs = torch.cat([pending.to(device), tree.tokens.to(device)])  # [m + N]
        out = session.forward(
            input_ids=inputs, position_ids=positions, attention_mask=mask, layers=hidden_layers, logits_rows=rows
        )
    else:
        if tree.verify_hidden is None or tree.verify_hidden.shape[0] != m + tree.num_nodes:
            raise ValueError(
                f"verification from layer {tree.verify_layer} needs the hidden states of the {m} pending tokens and "
                f"{tree.num_nodes} nodes entering it"
            )
        out = session.forward(
            hidden=tree.verify_hidden.to(device),
            start=tree.verify_layer,
            position_ids=positions,
            attention_mask=mask,
            layers=hidden_layers,
            logits_rows=rows,
        )
    logits = out.logits  # [N + 1, V]
    if chain:
        drafts = tree.tokens[None].to(device)  # [1, N]
        if temperature > 0:
            probs = None if tree.probs is None else tree.probs[None].to(device)  # [1, N, V]
            target_probs = probs_from_logits(logits, temperature)[None]  # [1, N + 1, V]
            n_acc, nxt = sampling_verify_chain(drafts, probs, target_probs, generator)
        else:
            n_acc, nxt = greedy_verify_chain(drafts, logits[None])
        path, token = list(range(int(n_acc[0]))), int(nxt[0])
    elif temperature > 0:
        path, token = sampling_verify_tree(tree, probs_from_logits(logits, temperature), generator)
    else:
        path, token = greedy_verify_tree(tree, logits)
    keep = torch.tensor(list(range(m)) + [m + i for i in path], dtype=torch.long, device=device)  # [n]: pending + path
    session.commit(keep)
    hidden = {i: out.layers[i].index_select(0, keep) for i in hidden_layers}  # layer -> [n, H]
    return VerifyOutput(path=path, token=token, hidden_states=hidden)


@torch.no_grad()
def speculative_generate(
    target: PreTrainedModel | TargetSession,
    input_ids: torch.Tensor,
    proposer: Proposer,
    k: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    accept_threshold: float = 0.0,
) -> GenerationResult:
    """Generate with speculative decoding; lossless: greedy output equals the target's, samples are distributed as it.

    Args:
        target: an HF causal LM (eval mode; its forward takes ``cache``, ``position_ids`` and a 4D ``attention_mask``),
            or a :class:`TargetSession` of one (reset here; proposers reach it through ``ProposalContext.session``).
        input_ids: ``[S]`` or ``[1, S]`` prompt tokens (one sequence).
        proposer: the source of drafts (:class:`NoProposer` for the target alone).
        k: the most drafts on one path per round.
        max_new_tokens: output budget; generation also stops after an EOS token.
        temperature: 0 for greedy verification, otherwise speculative sampling at this temperature.
        eos_token_id: token id(s) that end generation, or ``None``.
        generator: random generator on the target's device (sampling only).
        accept_threshold: dynamic draft length (0: off): drafts whose path's predicted acceptance is under it are not
            verified; the proposer must estimate acceptance (``estimates_acceptance``).
    """
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"speculative_generate takes one sequence, got a batch of {input_ids.shape[0]}")
        input_ids = input_ids[0]
    if input_ids.numel() == 0:
        raise ValueError("the prompt is empty")
    if k < 0 or max_new_tokens < 0:
        raise ValueError(f"k and max_new_tokens must be >= 0, got k={k}, max_new_tokens={max_new_tokens}")
    if not 0.0 <= accept_threshold <= 1.0:
        raise ValueError(f"accept_threshold must be in [0, 1], got {accept_threshold}")
    if accept_threshold > 0 and not getattr(proposer, "estimates_acceptance", False):
        raise ValueError(
            f"accept_threshold {accept_threshold}: {type(proposer).__name__} gives no acceptance estimate to cut its "
            "drafts by (dynamic draft length needs a proposer with estimates_acceptance)"
        )
    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    session = target if isinstance(target, TargetSession) else TargetSession(target)
    device = session.device
    layers = tuple(getattr(proposer, "needs_hidden_states", ()))
    vocab_size = session.vocab_size
    result = GenerationResult(tokens=[])
    if max_new_tokens == 0:
        return result
    proposer.reset()
    _sync(device)
    start_time = time.perf_counter()

    session.reset()
    committed = input_ids.to(device=device, dtype=torch.long)  # [T]
    hidden: dict[int, torch.Tensor] = {}
    token = -1
    while len(result.tokens) < max_new_tokens and token not in eos:
        remaining = max_new_tokens - len(result.tokens)
        first = not result.rounds
        # the first forward is also the prefill; a proposer that drafts from target hidden states gets them after it
        ctx = ProposalContext(
            tokens=committed,
            k=0 if first and layers else min(k, remaining - 1),
            temperature=temperature,
            generator=generator,
            vocab_size=vocab_size,
            hidden_states=hidden,
            session=session,
            accept_threshold=accept_threshold,
        )
        t0 = time.perf_counter()
        tree = proposer.propose(ctx) if ctx.k > 0 else DraftTree.empty(device)
        tree = tree.cut(accept_threshold)
        _sync(device)
        t1 = time.perf_counter()
        result.propose_seconds += t1 - t0
        depth = tree.max_depth()
        if depth > ctx.k:
            raise ValueError(f"{type(proposer).__name__} drafted a path of {depth} tokens, more than k={ctx.k}")
        if tree.num_nodes and int(tree.tokens.max()) >= vocab_size:
            raise ValueError(f"{type(proposer).__name__} drafted token {int(tree.tokens.max())} >= vocab {vocab_size}")

        pending = committed[session.committed :]  # [m]: the prompt in the first round, then the root
        verified = verify_round(session, pending, tree, temperature, generator, layers)
        path, token, hidden = verified.path, verified.token, verified.hidden_states
        _sync(device)
        elapsed = time.perf_counter() - t1
        result.target_seconds += elapsed
        if first:
            result.prefill_seconds = elapsed
        result.target_forwards += 1

        new_tokens = tree.tokens[path].tolist() + [token]
        new_tokens = new_tokens[:remaining]
        for j, t in enumerate(new_tokens):
            if t in eos:
                new_tokens = new_tokens[: j + 1]
                break
        result.rounds.append(
            RoundStats(
                drafted=depth, nodes=tree.num_nodes, accepted=len(path), committed=len(new_tokens),
                start=len(result.tokens),
            )
        )  # fmt: skip
        result.tokens.extend(new_tokens)
        token = new_tokens[-1]
        committed = torch.cat([committed, committed.new_tensor(new_tokens)])
    _sync(device)
    result.total_seconds = time.perf_counter() - start_time
    return result
