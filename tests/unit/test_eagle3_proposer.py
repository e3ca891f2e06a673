"""EAGLE-3 proposers are lossless: greedy speculative output equals the target's own greedy output, chain and tree,
with a random drafter on random float64 tiny Llama targets; the tree is a valid EAGLE-2 tree within its budget."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_llama
from trainer.decoding.generate import speculative_generate
from trainer.decoding.proposers import NoProposer, ProposalContext
from trainer.methods.eagle3.module import Eagle3Config, Eagle3Drafter
from trainer.methods.eagle3.proposer import Eagle3Proposer, Eagle3TreeProposer
from trainer.methods.eagle3.vocab_map import build_vocab_map

pytestmark = pytest.mark.usefixtures("one_thread")


def target_and_drafter(seed: int, vocab: int = 96, layers: int = 4):
    target = tiny_llama(seed, vocab, layers=layers)
    drafter = Eagle3Drafter(Eagle3Config.from_target(target.config, draft_vocab_size=vocab // 2)).to(torch.float64)
    drafter.set_vocab_map(*build_vocab_map(torch.randint(0, 50, (vocab,)), vocab // 2))
    return target, drafter


def first_round(target, drafter, k: int = 4) -> ProposalContext:
    """The context of a first round after 15 random tokens: the target's hidden states of the drafter's layers."""
    tokens = torch.randint(0, 96, (15,))
    with torch.no_grad():
        out = target(tokens[None, :-1], output_hidden_states=True)
    hidden = {i: out.hidden_states[i][0] for i in drafter.config.aux_layers}
    return ProposalContext(tokens=tokens, k=k, vocab_size=96, hidden_states=hidden)


@pytest.mark.parametrize("kind", ["chain", "tree"])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_is_lossless(kind, seed):
    target, drafter = target_and_drafter(seed)
    embedding = target.get_input_embeddings()
    if kind == "chain":
        proposer = Eagle3Proposer(drafter, embedding)
    else:
        proposer = Eagle3TreeProposer(drafter, embedding, top_k=3, budget=10)
    prompt = torch.randint(0, 96, (12,))
    alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=30)
    for k in (1, 4):
        spec = speculative_generate(target, prompt, proposer, k=k, max_new_tokens=30)
        assert spec.tokens == alone.tokens
        assert spec.target_forwards <= len(spec.tokens)
        if kind == "tree" and k > 1:
            assert max(r.nodes for r in spec.rounds) > max(r.drafted for r in spec.rounds)  # really a tree


def test_tree_respects_depth_budget_and_mirrors_the_chain():
    """The tree's top path starts with the chain's greedy drafts, and a top_k=1 tree is exactly the chain."""
    target, drafter = target_and_drafter(3)
    embedding, ctx = target.get_input_embeddings(), first_round(target, drafter)
    chain = Eagle3Proposer(drafter, embedding).propose(ctx)
    tree = Eagle3TreeProposer(drafter, embedding, top_k=3, budget=9).propose(ctx)
    assert tree.num_nodes == 9 and tree.max_depth() <= 4
    assert tree.tokens[0] == chain.tokens[0]  # the most probable child of the root comes first
    single = Eagle3TreeProposer(drafter, embedding, top_k=1, budget=4).propose(ctx)
    assert torch.equal(single.tokens, chain.tokens) and single.is_chain()
    # a cache that does not match the context is an error, not a silent wrong draft
    proposer = Eagle3Proposer(drafter, embedding)
    proposer.propose(ctx)
    with pytest.raises(RuntimeError, match="drafter's cache"):
        proposer.propose(ctx)


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_rank_temperature_spends_the_budget_on_the_greedy_path(seed):
    """A drafter with a flat distribution but a clear argmax (logits of spread ~1 over 48 tokens): ranked at
    temperature 1 the 8-node budget goes to width, ranked at the default 0.1 the tree holds the chain's whole path."""
    target, drafter = target_and_drafter(seed)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(1.0 / drafter.lm_head.weight.std() / 32**0.5)  # logits of spread ~1
    embedding, ctx = target.get_input_embeddings(), first_round(target, drafter)
    chain = Eagle3Proposer(drafter, embedding).propose(ctx).tokens  # [4]

    def greedy_path(tree) -> list[int]:
        """Tokens along the first child at every depth (children follow their parents in node order)."""
        path, node = [], -1
        while True:
            children = [i for i, p in enumerate(tree.parents.tolist()) if p == node]
            if not children:
                return path
            node = children[0]
            path.append(int(tree.tokens[node]))

    wide = Eagle3TreeProposer(drafter, embedding, top_k=3, budget=8, rank_temperature=1.0).propose(ctx)
    deep = Eagle3TreeProposer(drafter, embedding, top_k=3, budget=8).propose(ctx)
    assert wide.max_depth() < 4
    assert deep.max_depth() == 4 and greedy_path(deep) == chain.tolist()
    with pytest.raises(ValueError, match="rank_temperature"):
        Eagle3TreeProposer(drafter, embedding, rank_temperature=0.0)


def test_sampled_chain_returns_the_distributions_it_drew_from():
    target, drafter = target_and_drafter(4)
    embedding = target.get_input_embeddings()
    tokens = torch.randint(0, 96, (10,))
    with torch.no_grad():
        out = target(tokens[None, :-1], output_hidden_states=True)
    hidden = {i: out.hidden_states[i][0] for i in drafter.config.aux_layers}
    g = torch.Generator().manual_seed(0)
    ctx = ProposalContext(tokens=tokens, k=3, temperature=0.7, generator=g, vocab_size=96, hidden_states=hidden)
    tree = Eagle3TreeProposer(drafter, embedding).propose(ctx)  # a sampled chain at a temperature
    assert tree.is_chain() and tree.probs is not None and tree.probs.shape == (3, 96)
    torch.testing.assert_close(tree.probs.sum(-1), torch.ones(3, dtype=tree.probs.dtype))
    assert bool((tree.probs[:, ~drafter.t2d] == 0).all())  # no mass outside the draft vocabulary
    assert bool((tree.probs[torch.arange(3), tree.tokens] > 0).all())
    # speculative sampling runs end to end with these distributions
    result = speculative_generate(target, tokens, Eagle3Proposer(drafter, embedding), k=3, max_new_tokens=12,
                                  temperature=0.7, generator=torch.Generator().manual_seed(1))  # fmt: skip
    assert len(result.tokens) == 12


def test_eagle3_and_peagle_proposers_refuse_hidden_states_that_skip_positions_naming_their_method():
    """The new positions of a round are read by one function (eagle3/proposer.py ``new_positions``) for EAGLE-3 and
    P-EAGLE: hidden states that do not start where the drafter's cache ends, or lack a layer, are refused."""
    from trainer.methods.peagle.module import PEagleConfig, PEagleDrafter
    from trainer.methods.peagle.proposer import PEagleProposer

    target, drafter = target_and_drafter(0)
    peagle = PEagleDrafter(PEagleConfig(**drafter.config.to_dict(), mask_token_id=95)).to(torch.float64)
    peagle.set_vocab_map(drafter.d2t, drafter.t2d)
    ctx = first_round(target, drafter)
    for proposer, method in ((Eagle3Proposer(drafter, target.get_input_embeddings()), "EAGLE-3"),
                             (PEagleProposer(peagle, 4), "P-EAGLE")):  # fmt: skip
        proposer.propose(ctx)  # the cache now holds positions 0..13
        with pytest.raises(RuntimeError, match=rf"^{method} proposer: .* start at position 0 but the drafter's cache"):
            proposer.propose(ctx)
        proposer.reset()
        lacking = {i: h for i, h in ctx.hidden_states.items() if i != drafter.config.aux_layers[0]}
        missing = ProposalContext(tokens=ctx.tokens, k=4, vocab_size=96, hidden_states=lacking)
        with pytest.raises(ValueError, match=rf"the {method} proposer needs the target's hidden states of layers"):
            proposer.propose(missing)
