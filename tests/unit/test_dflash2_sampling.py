"""DFlash2's sampled drafts (trainer/methods/dflash2/proposer.py): each slot's draft is distributed as the q the
proposer returns for it (empirical frequencies against q, given the draft before), speculative sampling with DFlash2's
drafts is distributed as the target alone (an exact joint over every output of three tokens, with a selector that
never drafts most of the vocabulary), both with a control the test must catch (a q other than the one drawn from),
and the slot acceptance measurement (trainer/methods/dflash2/acceptance.py) against its definitions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import tiny_llama
from tests.unit.test_decoding_sampling import chi_square_p, exact_joint
from tests.unit.test_dflash2 import setup
from trainer.decoding.generate import speculative_generate
from trainer.decoding.proposers import ProposalContext
from trainer.losses.distribution import acceptance
from trainer.methods.dflash.module import DFlashConfig
from trainer.methods.dflash.proposer import DFlashProposer
from trainer.methods.dflash2.acceptance import (
    VocabularySampling,
    chain_tau,
    engine_tau,
    slot_acceptance,
)
from trainer.methods.dflash2.module import DFlash2Config, DFlash2Drafter
from trainer.methods.dflash2.proposer import DFlash2Proposer

pytestmark = pytest.mark.usefixtures("one_thread")


@torch.no_grad()
def drafts_of(proposer: DFlash2Proposer, n: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor, list]:
    """n sampled chains of 2 drafts from one block (one drafter forward): ([n, 2] drafts, [2, V] q of the first
    draw, [n] the q of each draw's slot 2 given its slot 1)."""
    target_layers = proposer.drafter.config.target_layers
    hidden = {
        i: torch.randn(5, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64) for i in target_layers
    }
    ctx = ProposalContext(
        torch.tensor([3, 8, 1, 44, 12, 9]), 2, temperature, torch.Generator().manual_seed(0), 128, hidden
    )
    proposer.reset()
    logits = proposer.block_logits(ctx)[:2]
    drafts, second = [], []
    for _ in range(n):
        tokens, probs, _, _ = proposer.draft_chain(ctx, logits)
        drafts.append(tokens)
        second.append(probs[1])
    return torch.stack(drafts), probs, second


def test_each_sampled_draft_is_distributed_as_the_q_returned_for_it():
    _, drafter = setup(1)
    target, _ = setup(1)
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    proposer = DFlash2Proposer(drafter, embedding, head)
    n, temperature = 6000, 0.8
    drafts, probs, second = drafts_of(proposer, n, temperature)
    top_k = drafter.config.selector_top_k
    # slot 1: every draw from the same q (the root is fixed), which holds the slot's top-k candidates only
    assert int((probs[0] > 0).sum()) == top_k and bool((probs[0][drafts[:, 0]] > 0).all())
    counts = torch.bincount(drafts[:, 0], minlength=128).double()
    assert chi_square_p(counts, n * probs[0]) > 1e-3
    backbone = torch.softmax(
        proposer.slot_hidden[0] @ head.detach().t() / temperature, -1
    )  # the full softmax: not drawn from
    assert chi_square_p(counts, n * backbone) < 1e-6
    # slot 2 given slot 1: for the commonest first draft, every q returned is the same, and the draws follow it
    first = int(counts.argmax())
    rows = [i for i in range(n) if int(drafts[i, 0]) == first]
    q = second[rows[0]]
    assert all(torch.equal(second[i], q) for i in rows)
    counts2 = torch.bincount(drafts[rows, 1], minlength=128).double()
    assert bool((q[drafts[rows, 1]] > 0).all()) and chi_square_p(counts2, len(rows) * q) > 1e-3
    other = next(i for i in range(n) if not torch.equal(second[i], q))  # another first draft: another q
    assert chi_square_p(counts2, len(rows) * second[other]) < 1e-6


class WrongQ(DFlash2Proposer):
    """Draws from the selector's candidates but returns the backbone's full softmax: the defect the tests catch."""

    def draft_chain(self, ctx, logits):
        tokens, _, rows, acceptance = super().draft_chain(ctx, logits)
        return tokens, torch.softmax(logits.float() / ctx.temperature, -1), rows, acceptance


def small_vocabulary(seed: int = 0) -> tuple[nn.Module, DFlash2Drafter]:
    """A sharp target of 4 tokens and a DFlash2 drafter unlike it whose selector keeps 2 candidates per slot."""
    target = tiny_llama(seed, vocab=4, layers=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    config = DFlashConfig.from_target(target.config, 2, (1, 3), block_size=4, mask_token_id=3)
    config = DFlash2Config(**{**config.to_dict(), "conv_group_size": 8, "selector_rank": 3, "selector_top_k": 2})
    torch.manual_seed(seed + 1)
    drafter = DFlash2Drafter(config)
    for p in drafter.parameters():
        nn.init.normal_(p, std=0.5)
    return target, drafter.to(torch.float64).eval()


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["dflash2", "vocabulary", "wrong-q"])
def test_speculative_sampling_with_dflash2_is_distributed_as_the_target(rule):
    target, drafter = small_vocabulary()
    vocab, length, n = 4, 3, 600
    prompt = torch.tensor([1, 2, 0, 1, 2])
    expected = exact_joint(target, prompt, length, 1.0) * n  # [V, V, V]
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    proposer = {"dflash2": DFlash2Proposer, "vocabulary": VocabularySampling, "wrong-q": WrongQ}[rule](
        drafter, embedding, head
    )
    counts = torch.zeros([vocab] * length)
    gen = torch.Generator().manual_seed(0)
    accepted = rejected = 0
    for _ in range(n):
        result = speculative_generate(target, prompt, proposer, 2, length, 1.0, generator=gen)
        counts[tuple(result.tokens)] += 1
        accepted += sum(r.accepted for r in result.rounds)
        rejected += sum(r.accepted < r.drafted for r in result.rounds)
    assert accepted > 0 and rejected > 0  # both branches of the rule were taken
    if rule != "wrong-q":
        assert chi_square_p(counts, expected) > 1e-3
    else:
        assert chi_square_p(counts, expected) < 1e-6


def test_acceptance_and_chain_tau():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.0, 0.6, 0.2, 0.2])
    assert float(acceptance(q, p)) == pytest.approx(0.5)  # 1 - TV: 0.3 + 0.2
    assert float(acceptance(p, p)) == pytest.approx(1.0)
    assert float(acceptance(torch.tensor([0.0, 1.0, 0.0, 0.0]), p)) == pytest.approx(0.3)  # one-hot: p(x)
    assert chain_tau([0.5, 0.5]) == pytest.approx(1.75) and chain_tau([]) == 1.0


def test_slot_acceptance_against_its_definitions():
    target, drafter = setup(3)
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    proposer = DFlash2Proposer(drafter, embedding, head)
    prompts = [[5, 9, 17, 4, 60, 33], [8, 1, 2, 90]]
    result = slot_acceptance(target, proposer, prompts, 3, 5, 1.0, 0)
    assert result["anchors"] == [10.0, 8.0, 6.0]  # 5 anchors per prompt; slot s reached by 5 - s of them
    for s in range(3):
        assert 0 < result["selector"][s] <= result["p on candidates"][s] + 1e-12  # q lives on the candidates
        assert result["selector argmax"][s] <= result["top probability: target"][s] + 1e-12  # p(x) <= max p
        assert result["backbone"][s] > 0 and result["selector + rest"][s] > 0
        assert result["top probability: selector"][s] >= 1 / drafter.config.selector_top_k - 1e-12
    # without its bilinear term the selector is the backbone restricted to its top-k
    with torch.no_grad():
        drafter.candidate_selector.hidden_projection.weight.zero_()
    flat = slot_acceptance(target, proposer, prompts, 3, 5, 1.0, 0)
    torch.testing.assert_close(torch.tensor(flat["selector"]), torch.tensor(flat["backbone top-k"]))
    torch.testing.assert_close(torch.tensor(flat["selector argmax"]), torch.tensor(flat["backbone argmax"]))
    torch.testing.assert_close(torch.tensor(flat["selector + rest"]), torch.tensor(flat["backbone"]))
    # a DFlash drafter sharing DFlash2's backbone (identity convolutions aside) measured beside it
    baseline = DFlashProposer(drafter, embedding, head)
    both = slot_acceptance(target, proposer, prompts, 3, 5, 1.0, 0, baseline=baseline)
    torch.testing.assert_close(torch.tensor(both["baseline"]), torch.tensor(both["backbone"]))


def test_vocabulary_sampling_keeps_the_rest_of_the_vocabulary_and_the_greedy_drafts():
    target, drafter = setup(2)
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    ours, theirs = DFlash2Proposer(drafter, embedding, head), VocabularySampling(drafter, embedding, head)
    hidden = {i: torch.randn(5, 32, dtype=torch.float64) for i in drafter.config.target_layers}
    tokens = torch.tensor([3, 8, 1, 44, 12, 9])
    for proposer in (ours, theirs):
        proposer.reset()
    greedy = [p.propose(ProposalContext(tokens, 4, 0.0, None, 128, hidden)).tokens for p in (ours, theirs)]
    assert torch.equal(greedy[0], greedy[1])
    theirs.reset()
    tree = theirs.propose(ProposalContext(tokens, 4, 1.0, torch.Generator().manual_seed(0), 128, hidden))
    unary = theirs.slot_hidden @ head.detach().t()  # [b - 1, V]
    prev = tokens[-1:]
    for k in range(4):  # q: the candidates rescored given the draft before, every other token its unary logit
        row = theirs.slot_logits(k, prev, unary)
        logits = torch.where(torch.isfinite(row), row, unary[k])
        torch.testing.assert_close(tree.probs[k].double(), torch.softmax(logits, -1), rtol=1e-5, atol=1e-7)
        assert bool((tree.probs[k] > 0).all())  # every token may be drafted
        prev = tree.tokens[k : k + 1]
    # without the bilinear term it is the backbone's softmax, DFlash's rule
    with torch.no_grad():
        drafter.candidate_selector.hidden_projection.weight.zero_()
    theirs.reset()
    tree = theirs.propose(ProposalContext(tokens, 4, 1.0, torch.Generator().manual_seed(0), 128, hidden))
    torch.testing.assert_close(tree.probs.double(), torch.softmax(theirs.slot_hidden[:4] @ head.detach().t(), -1))


def test_engine_tau_is_the_evals_tau():
    target, drafter = small_vocabulary()
    proposer = DFlash2Proposer(drafter, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    prompts = [[1, 2, 0, 1, 2], [3, 0, 2]]
    rounds = []
    for i, prompt in enumerate(prompts):  # draftsmith eval's seeds: seed + prompt index
        gen = torch.Generator().manual_seed(3 + i)
        rounds += speculative_generate(target, torch.tensor(prompt), proposer, 3, 12, 1.0, generator=gen).rounds
    tau = sum(r.committed for r in rounds) / len(rounds)
    assert engine_tau(target, proposer, prompts, 3, 12, 1.0, 3) == pytest.approx(tau) and tau > 1
