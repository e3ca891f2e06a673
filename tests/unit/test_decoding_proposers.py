"""The proposer side: registry, the hidden-states hook, and the draft model's cache reuse."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_llama
from trainer.decoding.generate import speculative_generate
from trainer.decoding.options import ProposerOptions
from trainer.decoding.proposers import (
    NoProposer,
    OracleProposer,
    ProposalContext,
    build_proposer,
    register_proposer,
    registered_proposers,
)
from trainer.decoding.tree import DraftTree
from trainer.methods.draft_model.proposer import DraftModelProposer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_registry_of_drafters_without_weights() -> None:
    assert set(registered_proposers()) >= {"none", "prompt-lookup", "early-exit"}
    assert isinstance(build_proposer("none", None), NoProposer)
    with pytest.raises(ValueError, match="unknown proposer 'medusa-x'"):
        build_proposer("medusa-x", None)
    with pytest.raises(ValueError, match="already registered"):
        register_proposer("none")(OracleProposer.__class__("Other", (NoProposer,), {}))
    with pytest.raises(TypeError, match="from_options"):
        register_proposer("no-factory")(OracleProposer)
    with pytest.raises(ValueError, match="--exit_layer"):
        build_proposer("early-exit", None)
    target = tiny_llama(0, layers=3)
    assert build_proposer("early-exit", target, ProposerOptions(exit_layer=2)).exit_layer == 2
    with pytest.raises(ValueError, match="exit layer 3 must be in 1..2"):
        build_proposer("early-exit", target, ProposerOptions(exit_layer=3))


class HiddenStateProbe(OracleProposer):
    """Asks for target hidden states and checks them against a fresh forward of the target every round."""

    needs_hidden_states = (0, 1, 2)

    def __init__(self, reference: torch.Tensor, prompt_length: int, target) -> None:
        super().__init__(reference, prompt_length)
        self.target, self.calls = target, 0

    def propose(self, ctx: ProposalContext) -> DraftTree:
        assert set(ctx.hidden_states) == {0, 1, 2}
        with torch.no_grad():
            fresh = self.target(input_ids=ctx.tokens[None, :-1], output_hidden_states=True).hidden_states
        for layer, states in ctx.hidden_states.items():
            n = states.shape[0]  # the tokens that entered the target's cache in the last forward
            torch.testing.assert_close(states, fresh[layer][0, -n:], rtol=0, atol=1e-9)
        self.calls += 1
        tree = super().propose(ctx)
        return DraftTree.chain(tree.tokens[:-1]) if self.calls % 2 else tree  # also some rejections of nothing


def test_hidden_states_hook_gives_the_target_states_of_the_new_cache_entries() -> None:
    target = tiny_llama(6)
    prompt = torch.randint(0, 128, (7,), generator=torch.Generator().manual_seed(6))
    reference = speculative_generate(target, prompt, NoProposer(), 1, 20).tokens
    probe = HiddenStateProbe(torch.cat([prompt, torch.tensor(reference)]), 7, target)
    result = speculative_generate(target, prompt, probe, 3, 20)
    assert result.tokens == reference
    assert result.rounds[0].drafted == 0  # the prompt's hidden states come first, from a plain prefill
    assert probe.calls == len(result.rounds) - 1


class CountingModel(torch.nn.Module):
    """Wraps a draft model and counts the tokens it is fed."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model, self.fed, self.config = model, 0, model.config

    def forward(self, input_ids, **kwargs):
        self.fed += input_ids.shape[1]
        return self.model(input_ids=input_ids, **kwargs)


def test_draft_model_reuses_its_cache_across_rounds() -> None:
    target, draft = tiny_llama(7), tiny_llama(8)
    prompt = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(7))
    counting = CountingModel(draft)
    result = speculative_generate(target, prompt, DraftModelProposer(counting), 4, 30)
    assert result.tokens == speculative_generate(target, prompt, NoProposer(), 1, 30).tokens
    # without reuse every round would refeed the whole context (> 10 tokens per round)
    drafted = sum(r.drafted for r in result.rounds)
    assert counting.fed <= prompt.numel() + drafted + 2 * len(result.rounds)
