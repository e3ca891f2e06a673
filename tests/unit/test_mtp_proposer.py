"""The MTP proposer: lossless greedy decoding on Llama and DeepSeek-V3 targets (chains, trees, reused modules), every
draft of a chain of K <= D drawn from exactly the distribution the training unroll gives at that position, the
hidden state it asks the session for, and the module count refused when it does not divide the drafts asked."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers import tiny_llama, tiny_model
from trainer.decoding.generate import speculative_generate
from trainer.decoding.proposers import NoProposer
from trainer.decoding.session import FINAL_PRENORM
from trainer.methods.mtp.module import MTPConfig, MTPDrafter
from trainer.methods.mtp.proposer import MTPProposer

VOCAB = 16  # small, so that random modules get drafts accepted and rounds commit several tokens


@functools.cache
def target_of(family: str):
    if family == "llama":
        return tiny_llama(1, vocab=VOCAB, hidden=32, layers=2)
    return tiny_model("deepseek_v3", 1, vocab=VOCAB, layers=2)


def trunk_hidden(target, rows: torch.Tensor, side: str) -> torch.Tensor:
    """[B, S, H] the target's last hidden states after (or before) its final norm."""
    decoder = target.get_decoder()
    captured = {}
    handle = decoder.norm.register_forward_pre_hook(lambda module, args: captured.setdefault("pre", args[0]))
    with torch.no_grad():
        post = decoder(input_ids=rows).last_hidden_state
    handle.remove()
    return post if side == "after_norm" else captured["pre"]


@functools.cache
def fitted(family: str, depth: int, seed: int = 0, steps: int = 30, trunk_hidden: str = "auto") -> MTPDrafter:
    """Modules for ``target_of(family)`` fitted for a few steps to its greedy continuations (so that drafts get
    accepted), built once per session."""
    return modules_for(target_of(family), depth, seed, steps, trunk_hidden=trunk_hidden)


def modules_for(target, depth: int, seed: int = 0, steps: int = 30, **config) -> MTPDrafter:
    """Modules fitted for a few steps to the target's greedy continuations (so that drafts get accepted)."""
    torch.manual_seed(seed)
    mtp_config = MTPConfig.for_trunk(target.config, depth, **config)
    drafter = MTPDrafter(mtp_config).to(torch.float64)
    prompts = torch.randint(0, VOCAB, (4, 4), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        rows = target.generate(prompts, max_new_tokens=36, do_sample=False, pad_token_id=0)  # [4, 40]
    hidden = trunk_hidden(target, rows, mtp_config.trunk_hidden)
    optimizer = torch.optim.Adam(drafter.mtp.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = 0.0
        for k, out in drafter.mtp.unroll(hidden, rows, target.get_input_embeddings()):  # out [4, 39 - k, H]
            logits = target.lm_head(drafter.mtp.head_input(k, out[:, :-1]))  # index i predicts token i + k + 2
            loss = loss + torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, k + 2 :].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


def proposer_for(target, drafter: MTPDrafter, **options) -> MTPProposer:
    return MTPProposer(
        drafter.mtp, target.get_input_embeddings(), target.get_output_embeddings(), target.config.num_hidden_layers,
        **options,
    )  # fmt: skip


PROMPT = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
@pytest.mark.parametrize(("depth", "ks"), [(1, (3,)), (2, (2, 4)), (3, (1, 6))])
def test_greedy_output_is_the_targets(family, depth, ks, one_thread):
    target = target_of(family)
    reference = speculative_generate(target, PROMPT, NoProposer(), 1, 40).tokens
    drafter = fitted(family, depth)
    accepted = 0
    for k in ks:
        for tree in (False, True):
            result = speculative_generate(target, PROMPT, proposer_for(target, drafter, tree=tree), k, 40)
            assert result.tokens == reference, (k, tree)
            accepted += sum(r.accepted for r in result.rounds)
        sampled = speculative_generate(
            target, PROMPT, proposer_for(target, drafter), k, 20, temperature=1.0,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        assert len(sampled.tokens) == 20
    assert accepted > 0  # rounds that committed several tokens were exercised


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_chain_drafts_follow_the_training_unroll(family, one_thread):
    """Each round of a K = D chain: draft j's logits equal module j's logits at index T - 2 of the training unroll over
    the committed tokens followed by the round's drafts (the trunk's hidden states of that stream)."""
    depth = 3
    target = target_of(family)
    drafter = fitted(family, depth)
    proposer = proposer_for(target, drafter)
    rounds: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    original_propose, original_logits = proposer.propose, proposer._logits

    def logits_spy(k, out, vocab_size):
        logits = original_logits(k, out, vocab_size)
        rounds[-1][1].append(logits)
        return logits

    def propose_spy(ctx):
        rounds.append((ctx.tokens.clone(), []))
        return original_propose(ctx)

    proposer._logits, proposer.propose = logits_spy, propose_spy
    result = speculative_generate(target, PROMPT, proposer, depth, 30)
    assert sum(r.accepted for r in result.rounds) > 0
    mtp = drafter.mtp
    tolerance = 1e-10 if family == "llama" else 1e-6  # DeepSeek's MoE router scores in float32
    checked = 0
    for tokens, step_logits in rounds:
        T = tokens.numel()
        drafts = torch.stack([logits.argmax() for logits in step_logits])
        stream = torch.cat([tokens, drafts])[None]  # [1, T + K]
        with torch.no_grad():
            hidden = target(input_ids=stream, output_hidden_states=True).hidden_states[-1]  # final normed output
            outs = dict(mtp.unroll(hidden, stream, target.get_input_embeddings()))
        for j, logits in enumerate(step_logits[:depth]):
            expected = target.lm_head(mtp.head_input(j, outs[j][0, T - 2]))
            torch.testing.assert_close(logits, expected, rtol=tolerance, atol=tolerance)
            checked += 1
    assert checked == sum(min(depth, len(step_logits)) for _, step_logits in rounds) > 0


def test_prenorm_modules_read_the_prenorm_hidden_state(one_thread):
    target = target_of("llama")
    drafter = fitted("llama", 1, trunk_hidden="before_norm")
    proposer = proposer_for(target, drafter)
    assert proposer.needs_hidden_states == (FINAL_PRENORM,)
    assert proposer_for(target, fitted("llama", 1)).needs_hidden_states == (2,)  # HF hidden_states[L]
    reference = speculative_generate(target, PROMPT, NoProposer(), 1, 30).tokens
    assert speculative_generate(target, PROMPT, proposer, 3, 30).tokens == reference


def test_tree_holds_siblings_within_the_budget(one_thread):
    target = target_of("llama")
    drafter = fitted("llama", 2)
    proposer = proposer_for(target, drafter, tree=True, tree_nodes=10, tree_top_k=3, rank_temperature=1.0)
    trees = []
    original = proposer.propose
    proposer.propose = lambda ctx: trees.append(original(ctx)) or trees[-1]
    speculative_generate(target, PROMPT, proposer, 4, 20)
    assert all(1 < tree.num_nodes <= 10 and tree.max_depth() <= 4 for tree in trees)
    assert any(not tree.is_chain() for tree in trees)


def test_a_module_count_that_does_not_divide_the_drafts_is_refused(one_thread):
    target = target_of("llama")
    proposer = proposer_for(target, modules_for(target, 2, steps=0))
    for k in (1, 2, 4, 6):
        proposer.check_k(k)
    with pytest.raises(ValueError, match="3 speculative tokens per round from 2 MTP modules: 2 does not divide 3"):
        proposer.check_k(3)
    with pytest.raises(ValueError, match="2 does not divide 5"):
        speculative_generate(target, PROMPT, proposer, 5, 20)
