"""Trees of per-head top-k paths: validation, the Medusa paper's tree, trees for a node budget, and lossless drafting
with parallel heads in the engine."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.helpers import tiny_llama
from trainer.decoding.generate import speculative_generate
from trainer.decoding.head_tree import (
    MEDUSA_SPARSE_TREE,
    chain,
    check_choices,
    head_accuracy,
    tree_for_budget,
    tree_from_choices,
    tree_or_default,
)
from trainer.decoding.heads_proposer import ParallelHeadsProposer
from trainer.decoding.proposers import NoProposer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_papers_tree_is_valid_and_paths_become_nodes_under_their_prefix() -> None:
    paths = check_choices(MEDUSA_SPARSE_TREE, 4)
    assert len(paths) == 63 and max(len(p) for p in paths) == 4
    top = torch.arange(40).reshape(4, 10)  # head d's rank-r token is 10 d + r
    tree = tree_from_choices(paths, top)
    for i, path in enumerate(paths):
        assert int(tree.tokens[i]) == 10 * (len(path) - 1) + path[-1]
        parent = int(tree.parents[i])
        assert (parent == -1) if len(path) == 1 else paths[parent] == path[:-1]
    assert tree_from_choices(paths, top, max_depth=2).max_depth() == 2
    assert tree_from_choices(chain(3), top).is_chain()


@pytest.mark.parametrize(
    ("choices", "message"),
    [
        ([(0,), (1, 0)], "has no parent"),
        ([(0,), (0,)], "twice"),
        ([(0,), (0, 0), (0, 0, 0)], "more than the 2 heads"),
        ([(0,), ()], "empty path"),
        ([(-1,)], "negative rank"),
    ],
)
def test_bad_choices_are_named(choices, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_choices(choices, 2)


def test_tree_for_a_budget_is_the_best_prefix_closed_tree_under_independent_heads() -> None:
    accuracy = torch.tensor([[0.6, 0.2, 0.1], [0.5, 0.3, 0.1]], dtype=torch.float64)

    def value(paths):
        return sum(float(torch.prod(torch.stack([accuracy[d, r] for d, r in enumerate(p)]))) for p in paths)

    every = [p for d in (1, 2) for p in itertools.product(range(3), repeat=d)]  # 12 paths
    for nodes in (1, 4, 6, 12):
        tree = tree_for_budget(accuracy, nodes)
        assert len(tree) == nodes
        check_choices(tree, 2)  # every prefix present
        # brute force over every prefix-closed set of that size
        best = max(value(c) for c in itertools.combinations(every, nodes) if all(len(p) == 1 or p[:-1] in c for p in c))
        assert value(tree) == pytest.approx(best)
    ranks = torch.tensor([[0, 1], [0, 0], [2, 0], [1, 5]])
    torch.testing.assert_close(
        head_accuracy(ranks, 3), torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.25, 0.0]], dtype=torch.float64)
    )


class RandomHeads(ParallelHeadsProposer):
    """K heads with fixed random logits per position: drafts right or wrong at random."""

    def __init__(self, heads: int, vocab: int, choices=None) -> None:
        super().__init__(layer=0, num_heads=heads, choices=choices)
        self.vocab = vocab

    def head_logits(self, ctx):
        g = torch.Generator().manual_seed(int(ctx.tokens.sum()))
        return torch.randn(self.max_drafts, self.vocab, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("choices", [None, MEDUSA_SPARSE_TREE])
def test_parallel_heads_drafts_are_lossless_chain_and_tree(choices) -> None:
    target = tiny_llama(0, vocab=16)  # a small vocabulary: random top-k guesses are often right
    prompt = torch.randint(0, 16, (6,), generator=torch.Generator().manual_seed(0))
    reference = speculative_generate(target, prompt, NoProposer(), 1, 24).tokens
    proposer = RandomHeads(4, 16, choices)
    result = speculative_generate(target, prompt, proposer, 4, 24)
    assert result.tokens == reference
    assert sum(r.accepted for r in result.rounds) > 0
    with pytest.raises(ValueError, match="5 drafts per round asked of 4 heads"):
        speculative_generate(target, prompt, proposer, 5, 24)


def test_the_default_tree_is_the_papers_for_4_and_named_otherwise() -> None:
    assert tree_or_default(None, 4, "heads") is MEDUSA_SPARSE_TREE
    assert tree_or_default(((0,), (0, 0)), 3, "depths") == ((0,), (0, 0))
    with pytest.raises(ValueError, match=r"--tree for 3 depths needs --tree_choices FILE .* the depths' measured"):
        tree_or_default(None, 3, "depths")
