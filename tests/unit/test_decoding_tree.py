"""Tree verification: ancestor mask, positions, the longest accepted path, and cache compaction."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from tests.helpers import tiny_llama
from trainer.decoding.cache import compact_cache, truncate_cache
from trainer.decoding.generate import speculative_generate, verify_round
from trainer.decoding.proposers import NoProposer, ProposalContext
from trainer.decoding.session import TargetSession
from trainer.decoding.tree import DraftTree
from trainer.decoding.verify import greedy_verify_chain, greedy_verify_tree

pytestmark = pytest.mark.usefixtures("one_thread")


def prefilled(target, prompt: torch.Tensor) -> TargetSession:
    """A session whose cache holds every prompt token but the last (the root of the first round), committed."""
    session = TargetSession(target)
    session.forward(input_ids=prompt[:-1])
    session.commit(torch.arange(prompt.numel() - 1))
    return session


def assert_same_cache(a: DynamicCache, b: DynamicCache) -> None:
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        assert la.keys.shape == lb.keys.shape
        torch.testing.assert_close(la.keys, lb.keys, rtol=0, atol=1e-10)
        torch.testing.assert_close(la.values, lb.values, rtol=0, atol=1e-10)


def test_ancestor_mask_and_positions_match_a_naive_reference() -> None:
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 5])
    tree = DraftTree(tokens=torch.arange(7), parents=parents)
    mask = tree.ancestor_mask()
    for i in range(8):
        ancestors = {0} | {n + 1 for n in tree.path_to(i - 1)}
        assert {j for j in range(8) if mask[i, j]} == ancestors
    assert tree.position_ids(10)[0].tolist() == [10, 11, 11, 12, 12, 12, 13, 14]
    additive = tree.attention_mask(3, torch.float32)
    assert additive.shape == (1, 1, 8, 11)
    assert bool((additive[0, 0, :, :3] == 0).all())
    assert bool(((additive[0, 0, :, 3:] == 0) == mask).all())
    assert not DraftTree(tokens=torch.arange(3), parents=torch.tensor([-1, 0, 0])).is_chain()
    assert DraftTree.chain(torch.arange(3)).is_chain()


def test_hand_built_tree_accepts_known_path_and_compacts_cache() -> None:
    target = tiny_llama(0, vocab=96)
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab, (8,), generator=torch.Generator().manual_seed(0))
    g = speculative_generate(target, prompt, NoProposer(), 1, 5).tokens  # the target's greedy continuation
    wrong = lambda t: (t + 1) % vocab  # noqa: E731
    nodes = [  # (token, parent): the right path is nodes 1 -> 4 -> 5; nodes 2 and 6 hang under a rejected node
        (wrong(g[0]), -1), (g[0], -1), (g[1], 0), (wrong(g[1]), 1), (g[1], 1), (g[2], 4), (g[2], 2), (wrong(g[3]), 5),
    ]  # fmt: skip
    tree = DraftTree(tokens=torch.tensor([t for t, _ in nodes]), parents=torch.tensor([p for _, p in nodes]))
    session = prefilled(target, prompt)
    layers = (0, 2)
    out = verify_round(session, prompt[-1:], tree, hidden_layers=layers)
    assert out.path == [1, 4, 5]
    assert out.token == g[3]
    # the compacted cache equals a fresh forward over the committed tokens
    committed = torch.cat([prompt, torch.tensor(g[:3])])  # [11]
    fresh = DynamicCache(config=target.config)
    with torch.no_grad():
        ref = target(input_ids=committed[None], cache=fresh, use_cache=True, output_hidden_states=True)
    assert_same_cache(session.cache, fresh)
    assert session.committed == committed.numel()
    for layer in layers:  # hidden states of the root and the accepted nodes
        torch.testing.assert_close(out.hidden_states[layer], ref.hidden_states[layer][0, 7:], rtol=0, atol=1e-10)
    # the longest path wins over a shorter accepted one, whatever the node order
    path, _ = greedy_verify_tree(tree, torch.nn.functional.one_hot(torch.tensor([g[0]] + [0] * 8), vocab).double())
    assert path == [1]


def test_chain_as_tree_gives_chain_output_and_cache() -> None:
    target = tiny_llama(1, vocab=96)
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab, (10,), generator=torch.Generator().manual_seed(1))
    g = speculative_generate(target, prompt, NoProposer(), 1, 4).tokens
    for drafts in ([g[0], g[1], (g[2] + 3) % vocab], [g[0], g[1], g[2]], [(g[0] + 1) % vocab]):
        tree = DraftTree.chain(torch.tensor(drafts))
        chain_session, tree_session = prefilled(target, prompt), prefilled(target, prompt)
        as_chain = verify_round(chain_session, prompt[-1:], tree, tree_mask=False)
        as_tree = verify_round(tree_session, prompt[-1:], tree, tree_mask=True)
        assert as_chain.path == as_tree.path and as_chain.token == as_tree.token
        assert_same_cache(chain_session.cache, tree_session.cache)
        # and the tree rule on a chain agrees with the batched chain rule
        logits = torch.randn(len(drafts) + 1, vocab, dtype=torch.float64)
        n, nxt = greedy_verify_chain(tree.tokens[None], logits[None])
        path, token = greedy_verify_tree(tree, logits)
        assert len(path) == int(n[0]) and token == int(nxt[0])


class TopTwoTree:
    """A proposer drafting a width-2 tree: two guesses per level, one of them the oracle's token."""

    needs_hidden_states: tuple[int, ...] = ()

    def __init__(self, reference: list[int], vocab: int) -> None:
        self.reference, self.vocab = reference, vocab

    def reset(self) -> None:
        pass

    def propose(self, ctx: ProposalContext) -> DraftTree:
        start = ctx.tokens.numel()
        tokens, parents, parent = [], [], -1
        for right in self.reference[start : start + ctx.k]:
            tokens += [(right + 1) % self.vocab, right]  # the wrong sibling first
            parents += [parent, parent]
            parent = len(tokens) - 1
        return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents))


def test_tree_proposer_in_the_engine_is_lossless_and_accepts_the_right_branch() -> None:
    target = tiny_llama(2, vocab=96)
    prompt = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(2))
    reference = speculative_generate(target, prompt, NoProposer(), 1, 20).tokens
    for k in (1, 3, 5):
        result = speculative_generate(target, prompt, TopTwoTree(prompt.tolist() + reference, 96), k, 20)
        assert result.tokens == reference
        assert all(r.accepted == r.drafted for r in result.rounds)


def test_compact_and_truncate_cache_on_known_values() -> None:
    target = tiny_llama(3, vocab=96)
    cache = prefilled(target, torch.arange(11)).cache  # 10 tokens cached
    before = [layer.keys.clone() for layer in cache.layers]
    compact_cache(cache, 4, torch.tensor([1, 3, 4]))
    for layer, old in zip(cache.layers, before):
        assert torch.equal(layer.keys, old[:, :, [0, 1, 2, 3, 5, 7, 8]])
    truncate_cache(cache, 5)
    assert cache.get_seq_length() == 5
    compact_cache(cache, 2, torch.tensor([0, 1]))  # a prefix: a crop
    assert cache.get_seq_length() == 4
