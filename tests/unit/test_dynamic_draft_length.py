"""Dynamic draft length (``accept_threshold``): a chain stops, a tree is pruned, where the drafter's predicted chance
that the path is accepted falls under the threshold.

- :meth:`DraftTree.cut` against a naive reference (paths from the root, the sibling rule for sampled nodes);
- every kind that estimates (draft model, EAGLE-3 and P-EAGLE chain and tree, Medusa and MTP heads chain and tree,
  MTP modules chain and tree) stays lossless with the threshold on: greedy output identical to the target's, on
  random float64 tiny targets, with rounds of really varying length; what a sequential drafter stops is what the
  engine would cut (a shadow proposer drafting the whole chain checks each round);
- sampling stays exact: the estimate of a sampled draft never depends on the token drawn (checked per kind), and a
  chi-square test shows the committed tokens distributed as the target's with a cut on the distributions, and not
  with a cut on the drawn token's own probability (the mistake the rule avoids);
- the threshold is refused outside [0, 1], and for a proposer that gives no estimate.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tests.helpers import tiny_llama
from tests.unit.test_decoding_sampling import chi_square_p, markov
from trainer.decoding.generate import speculative_generate
from trainer.decoding.options import ProposerOptions
from trainer.decoding.proposers import (
    BaseProposer,
    ChainCut,
    NoProposer,
    PromptLookupProposer,
    ProposalContext,
    draft_confidence,
)
from trainer.decoding.tree import DraftTree
from trainer.decoding.verify import sampling_verify_chain
from trainer.interface.errors import UsageError
from trainer.methods.draft_model.proposer import DraftModelProposer
from trainer.methods.eagle3.module import Eagle3Config, Eagle3Drafter
from trainer.methods.eagle3.proposer import Eagle3Proposer, Eagle3TreeProposer
from trainer.methods.eagle3.vocab_map import build_vocab_map
from trainer.methods.medusa.module import MedusaConfig, MedusaDrafter
from trainer.methods.medusa.proposer import MedusaProposer
from trainer.methods.mtp.module import MTPConfig, MTPDrafter
from trainer.methods.mtp.proposer import MTPProposer
from trainer.methods.mtp_heads.module import MTPHeads
from trainer.methods.mtp_heads.proposer import MTPHeadsProposer
from trainer.methods.peagle.module import PEagleConfig, PEagleDrafter
from trainer.methods.peagle.proposer import PEagleProposer

pytestmark = pytest.mark.usefixtures("one_thread")

V = 24  # a small vocabulary: random drafters' top probabilities spread over 0.05..0.5, so thresholds really cut
TINY = 1e-300  # a threshold that cuts nothing but makes a proposer estimate (the shadow's whole chain)
PROMPT = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])


def naive_cut(tree: DraftTree, threshold: float) -> list[int]:
    """The nodes kept, by the definition: every node on the path to it (itself included) has a path product at or
    above the threshold, and with sampled nodes no earlier sibling of any of them was dropped."""
    conf = tree.confidence.double().tolist()

    def product(node: int) -> float:
        value = 1.0
        for n in tree.path_to(node):
            value *= conf[n]
        return value

    parents = tree.parents.tolist()
    kept: list[int] = []
    for i in range(tree.num_nodes):
        ok = all(product(n) >= threshold for n in tree.path_to(i))
        if tree.probs is not None:
            for n in tree.path_to(i):
                earlier = [j for j in range(n) if parents[j] == parents[n]]
                ok = ok and all(all(product(m) >= threshold for m in tree.path_to(j)) for j in earlier)
        if ok:
            kept.append(i)
    return kept


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_cut_keeps_the_paths_above_the_threshold(seed: int, sampled: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = 14
    parents = torch.tensor([-1] + [int(torch.randint(-1, i, (), generator=gen)) for i in range(1, n)])
    confidence = torch.rand(n, generator=gen, dtype=torch.float64) * 0.6 + 0.4  # [N]
    probs = torch.softmax(torch.randn(n, 7, generator=gen), -1) if sampled else None  # [N, 7]
    tree = DraftTree(torch.randint(0, 7, (n,), generator=gen), parents, probs, confidence=confidence)
    for threshold in (0.0, 0.2, 0.45, 0.7, 0.95):
        cut = tree.cut(threshold)
        kept = naive_cut(tree, threshold) if threshold > 0 else list(range(n))
        assert torch.equal(cut.tokens, tree.tokens[kept]) and torch.equal(cut.confidence, confidence[kept])
        index = {node: j for j, node in enumerate(kept)}
        assert cut.parents.tolist() == [index[p] if p >= 0 else -1 for p in tree.parents[kept].tolist()]
        if sampled:
            assert torch.equal(cut.probs, probs[kept])
        assert torch.all(cut.path_confidence() >= threshold)
    chain = DraftTree.chain(torch.tensor([5, 6, 7, 8]), confidence=torch.tensor([0.9, 0.8, 0.9, 0.1]))
    assert chain.cut(0.6).tokens.tolist() == [5, 6, 7] and chain.cut(0.7).tokens.tolist() == [5, 6]
    assert DraftTree.chain(torch.tensor([5, 6])).cut(0.9).num_nodes == 2  # no estimate: nothing to cut by


def test_the_threshold_is_refused_outside_0_1_and_for_a_proposer_without_estimate() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(UsageError, match=f"accept_threshold must be in \\[0, 1\\], got {bad}"):
            ProposerOptions(accept_threshold=bad)
    assert ProposerOptions(accept_threshold=1.0).accept_threshold == 1.0
    target = tiny_llama(0, vocab=V)
    with pytest.raises(ValueError, match="PromptLookupProposer gives no acceptance estimate"):
        speculative_generate(target, PROMPT, PromptLookupProposer(), 3, 8, accept_threshold=0.2)
    with pytest.raises(ValueError, match="accept_threshold must be in"):
        speculative_generate(target, PROMPT, NoProposer(), 3, 8, accept_threshold=2.0)
    assert not NoProposer().estimates_acceptance and BaseProposer.estimates_acceptance is False


def test_the_estimate_is_the_drafters_probability_and_a_chain_stops_under_the_threshold() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]], dtype=torch.float64)  # [2, 4]
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(draft_confidence(logits), probs.amax(-1))
    picked = draft_confidence(logits, torch.tensor([[1, 0], [2, 3]]))  # [2, 2]
    torch.testing.assert_close(picked, probs.gather(-1, torch.tensor([[1, 0], [2, 3]])))
    cut = ChainCut(0.5)
    assert cut.admit(torch.tensor(0.9)) and cut.admit(torch.tensor(0.6)) and not cut.admit(torch.tensor(0.9))
    assert cut.product == pytest.approx(0.54) and cut.confidence().tolist() == pytest.approx([0.9, 0.6])
    off = ChainCut(0.0)
    assert off.admit(torch.tensor(0.0)) and off.confidence() is None  # off: never stops, records nothing


# ---- every kind that estimates: lossless, really dynamic, and stopping where the engine would cut


def sharpened(module: torch.nn.Linear, factor: float) -> None:
    with torch.no_grad():
        module.weight.mul_(factor)


@functools.cache
def target_of(seed: int = 0):
    return tiny_llama(seed, vocab=V, hidden=32, layers=2)


def build(kind: str):
    """(target, a function making a fresh proposer, whether the proposer stops drafting itself, whether it equals the
    whole proposal cut by the engine's rule)."""
    target = target_of()
    L = target.config.num_hidden_layers
    torch.manual_seed(1)
    if kind == "draft-model":
        draft = tiny_llama(7, vocab=V, hidden=32, layers=1)
        sharpened(draft.lm_head, 6.0)
        return target, lambda: DraftModelProposer(draft), True, True
    if kind.startswith("eagle3"):
        drafter = Eagle3Drafter(Eagle3Config.from_target(target.config, draft_vocab_size=V // 2)).to(torch.float64)
        drafter.set_vocab_map(*build_vocab_map(torch.randint(0, 50, (V,)), V // 2))
        sharpened(drafter.lm_head, 40.0)
        embedding = target.get_input_embeddings()
        if kind == "eagle3-chain":
            return target, lambda: Eagle3Proposer(drafter, embedding), True, True
        return target, lambda: Eagle3TreeProposer(drafter, embedding, top_k=3, budget=10), True, False
    if kind.startswith("peagle"):
        base = Eagle3Config.from_target(target.config, draft_vocab_size=V // 2)
        drafter = PEagleDrafter(PEagleConfig(**base.to_dict(), mask_token_id=V - 1)).to(torch.float64)
        drafter.set_vocab_map(*build_vocab_map(torch.randint(0, 50, (V,)), V // 2))
        sharpened(drafter.lm_head, 40.0)
        choices = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)) if "tree" in kind else None
        return target, lambda: PEagleProposer(drafter, 4, choices), False, True
    if kind.startswith("medusa"):
        drafter = MedusaDrafter(MedusaConfig(hidden_size=32, vocab_size=V, num_heads=4, num_layers=1)).double()
        with torch.no_grad():
            for p in drafter.heads.parameters():
                p.copy_(torch.randn(p.shape) * 0.6)
        choices = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)) if "tree" in kind else None
        return target, lambda: MedusaProposer(drafter.heads, L, choices), False, True
    if kind.startswith("mtp_heads"):
        heads = MTPHeads(target, 5, head_init="random").eval()
        choices = ((0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0)) if "tree" in kind else None
        return target, lambda: MTPHeadsProposer(heads, choices), False, True
    drafter = MTPDrafter(MTPConfig.for_trunk(target.config, 2)).to(torch.float64).eval()
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    tree = kind == "mtp-tree"
    return (
        target,
        lambda: MTPProposer(drafter.mtp, embed, head, L, tree=tree, tree_nodes=8, tree_top_k=3),
        True,
        not tree,
    )


class Shadowed(BaseProposer):
    """Drafts with ``proposer`` and checks every round against ``shadow``, the same drafter on the same contexts
    drafting everything it can (a threshold that cuts nothing): the round is the shadow's cut by the engine's rule
    (``equal``), and a proposer that stops itself returns a tree the cut leaves unchanged."""

    estimates_acceptance = True

    def __init__(self, proposer, shadow, stops: bool, equal: bool) -> None:
        self.proposer, self.shadow, self.stops, self.equal = proposer, shadow, stops, equal
        self.needs_hidden_states = proposer.needs_hidden_states
        self.max_drafts = proposer.max_drafts
        self.checked = 0

    def reset(self) -> None:
        self.proposer.reset()
        self.shadow.reset()

    def propose(self, ctx: ProposalContext) -> DraftTree:
        tree = self.proposer.propose(ctx)
        full = self.shadow.propose(dataclasses.replace(ctx, accept_threshold=TINY))
        expected, got = full.cut(ctx.accept_threshold), tree.cut(ctx.accept_threshold)
        if self.equal:
            assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.parents, expected.parents)
        if self.stops:
            assert got.num_nodes == tree.num_nodes  # it stopped drafting where the engine cuts
        assert tree.confidence is not None or tree.num_nodes == 0
        self.checked += 1
        return tree


KINDS = [
    "draft-model", "eagle3-chain", "eagle3-tree", "peagle-chain", "peagle-tree", "medusa-chain", "medusa-tree",
    "mtp_heads-chain", "mtp_heads-tree", "mtp-chain", "mtp-tree",
]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_output_is_the_targets_with_the_threshold_on(kind: str) -> None:
    target, make, stops, equal = build(kind)
    k = 4
    reference = speculative_generate(target, PROMPT, NoProposer(), 1, 24).tokens
    lengths: set[int] = set()
    for threshold in (0.3, 0.03):
        proposer = Shadowed(make(), make(), stops, equal)
        result = speculative_generate(target, PROMPT, proposer, k, 24, accept_threshold=threshold)
        assert result.tokens == reference, threshold
        assert proposer.checked > 0
        lengths |= {r.drafted for r in result.rounds[1:-1]}  # not the prefill, nor a round cut by the budget
    assert any(0 < n < k for n in lengths) and len(lengths) > 1  # the draft length really varied


@pytest.mark.parametrize("kind", ["medusa-chain", "mtp_heads-tree"])
def test_parallel_heads_asked_for_fewer_drafts_than_heads(kind: str) -> None:
    """k below the head count: the estimates are those of the heads that drafted."""
    target, make, stops, equal = build(kind)
    reference = speculative_generate(target, PROMPT, NoProposer(), 1, 16).tokens
    proposer = Shadowed(make(), make(), stops, equal)
    assert speculative_generate(target, PROMPT, proposer, 2, 16, accept_threshold=0.03).tokens == reference


@pytest.mark.parametrize("kind", KINDS)
def test_a_sampled_drafts_estimate_does_not_depend_on_the_token_drawn(kind: str) -> None:
    """At temperature 1 a sampled draft's confidence is the top of the distribution it was drawn from; trees sample
    one-hot candidates (any estimate is then a function of the drafter's state)."""
    target, make, _, _ = build(kind)
    seen = []

    class Checked(BaseProposer):
        estimates_acceptance = True

        def __init__(self, inner) -> None:
            self.inner = inner
            self.needs_hidden_states, self.max_drafts = inner.needs_hidden_states, inner.max_drafts

        def reset(self) -> None:
            self.inner.reset()

        def propose(self, ctx: ProposalContext) -> DraftTree:
            tree = self.inner.propose(ctx)
            if tree.probs is not None and tree.num_nodes:
                torch.testing.assert_close(tree.confidence.double(), tree.probs.double().amax(-1))
                seen.append(tree.num_nodes)
            return tree

    gen = torch.Generator().manual_seed(0)
    result = speculative_generate(target, PROMPT, Checked(make()), 4, 24, 1.0, None, gen, accept_threshold=0.05)
    assert len(result.tokens) == 24
    assert seen or "tree" in kind


# ---- sampling stays exact: a cut on the distributions keeps it, a cut on the drawn token's probability does not


def committed_pairs(q: torch.Tensor, p: torch.Tensor, n: int, threshold: float, rule: str, seed: int) -> torch.Tensor:
    """``[n, 2]`` the first two tokens committed after root 0, drafting up to 2 tokens from a Markov drafter ``p``
    cut at ``threshold`` (``rule`` "top": the estimate is the distribution's top probability; "drawn": the drawn
    token's own probability), verified by speculative sampling against a Markov target ``q`` (a token the round did
    not commit is sampled from ``q``, as the next round's would be)."""
    gen = torch.Generator().manual_seed(seed)
    x1 = torch.multinomial(p[0].expand(n, -1), 1, generator=gen)[:, 0]  # [n]
    x2 = torch.multinomial(p[x1], 1, generator=gen)[:, 0]  # [n]
    if rule == "top":
        c1, c2 = p[0].max().expand(n), p[x1].amax(-1)  # [n], [n]
    else:
        c1, c2 = p[0, x1], p[x1, x2]
    length = (c1 >= threshold).long() + ((c1 >= threshold) & (c1 * c2 >= threshold)).long()  # [n]
    out = torch.zeros(n, 2, dtype=torch.long)
    for L in (0, 1, 2):
        rows = (length == L).nonzero().flatten()  # [m]
        if not rows.numel():
            continue
        drafts = torch.stack([x1[rows], x2[rows]], 1)[:, :L]  # [m, L]
        context = torch.cat([torch.zeros(rows.numel(), 1, dtype=torch.long), drafts], 1)  # [m, L + 1]
        probs = torch.stack([p[0].expand(rows.numel(), -1), p[x1[rows]]], 1)[:, :L]  # [m, L, V]
        n_acc, nxt = sampling_verify_chain(drafts, probs, q[context], gen)
        committed = torch.cat([drafts, torch.zeros(rows.numel(), 1, dtype=torch.long)], 1)  # [m, L + 1]
        committed[torch.arange(rows.numel()), n_acc] = nxt
        first = committed[:, 0]
        second = torch.where(
            n_acc >= 1, committed[:, 1] if L >= 1 else first, torch.multinomial(q[first], 1, generator=gen)[:, 0]
        )
        out[rows] = torch.stack([first, second], 1)
    return out


@pytest.mark.parametrize("rule", ["top", "drawn"])
def test_cutting_on_the_distribution_keeps_sampling_exact(rule: str) -> None:
    q, p = markov(0, 1.5), markov(1, 2.5)  # [6, 6] each
    n = 60000
    pairs = committed_pairs(q, p, n, 0.12, rule, seed=0)
    observed = torch.zeros(6, 6)
    observed.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(n), accumulate=True)
    expected = q[0][:, None] * q * n  # [6, 6]: q(x1 | 0) q(x2 | x1)
    p_value = chi_square_p(observed, expected)
    if rule == "top":
        assert p_value > 1e-3
    else:
        assert p_value < 1e-6  # the draft's presence tells about its value: biased


@pytest.mark.slow
def test_engine_samples_are_distributed_as_the_target_with_the_threshold_on() -> None:
    from tests.unit.test_decoding_sampling import exact_joint

    vocab, length, n = 4, 3, 600
    target = _scaled(tiny_llama(0, vocab), 8.0)
    draft = _scaled(tiny_llama(1, vocab), 16.0)
    prompt = torch.tensor([1, 2, 3, 0])
    expected = exact_joint(target, prompt, length, 1.0) * n  # [V, V, V]
    proposer = DraftModelProposer(draft)
    counts = torch.zeros([vocab] * length)
    gen = torch.Generator().manual_seed(0)
    drafted = set()
    for _ in range(n):
        result = speculative_generate(target, prompt, proposer, 2, length, 1.0, generator=gen, accept_threshold=0.3)
        counts[tuple(result.tokens)] += 1
        drafted |= {r.drafted for r in result.rounds}
    assert {0, 1, 2} <= drafted
    assert chi_square_p(counts, expected) > 1e-3


def _scaled(model, factor: float):
    sharpened(model.lm_head, factor)
    return model
