"""Cross-checks: transformers' assisted generation, prompt lookup on a copy-heavy prompt, and the metrics."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaForCausalLM, MistralConfig, MistralForCausalLM

from tests.helpers import tiny_llama
from trainer.decoding import metrics
from trainer.decoding.generate import RoundStats, speculative_generate
from trainer.decoding.proposers import NoProposer, PromptLookupProposer, ProposalContext
from trainer.methods.draft_model.proposer import DraftModelProposer

from .test_decoding_greedy import train_student

pytestmark = pytest.mark.usefixtures("one_thread")


def hf_assisted(target: LlamaForCausalLM, draft: LlamaForCausalLM, prompt: torch.Tensor, k: int, n: int):
    """transformers' assisted generation with a constant schedule: output tokens and target forward count."""
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0  # never stop drafting early
    calls = []
    hook = target.register_forward_hook(lambda *args: calls.append(1))
    try:
        out = target.generate(prompt[None], assistant_model=draft, do_sample=False, max_new_tokens=n)
    finally:
        hook.remove()
    return out[0, prompt.numel() :].tolist(), len(calls)


@pytest.mark.parametrize("drafter", ["random", pytest.param("kd-student", marks=pytest.mark.slow)])
def test_matches_transformers_assisted_generation(drafter: str) -> None:
    vocab = 64
    target = tiny_llama(5, vocab=vocab)
    target.generation_config.eos_token_id = None  # no early stop on either side (and no pad/eos masking of prompts)
    draft = tiny_llama(11, vocab=vocab) if drafter == "random" else train_student(target, vocab)
    gen = torch.Generator().manual_seed(0)
    for k in (1, 2, 4, 8):
        prompt = torch.randint(1, vocab, (5,), generator=gen)
        hf_tokens, hf_forwards = hf_assisted(target, draft, prompt, k, 24)
        ours = speculative_generate(target, prompt, DraftModelProposer(draft), k, 24)
        assert ours.tokens == hf_tokens
        # Both verify drafts made after the prompt in the first forward (which is also the prefill), cap the drafts
        # at the remaining budget minus one, and accept greedily: same rounds, so the same number of target forwards.
        # HF exposes no per-round counts; equal forwards for equal output means equal accepted tokens in total.
        assert ours.target_forwards == hf_forwards, f"K={k}"


def test_prompt_lookup_on_copy_heavy_prompt() -> None:
    # A sliding-window target (window 4) depends only on its last few tokens, so when the prompt contains a text and
    # then repeats its beginning, the target's continuation is a copy of that text: a truly copy-heavy prompt.
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4, max_position_embeddings=512,
    )  # fmt: skip
    target = MistralForCausalLM(config).to(torch.float64).eval()
    start = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(0))
    n = 14
    text = speculative_generate(target, start, NoProposer(), 1, n).tokens
    assert metrics.loop_share(text) == 0.0 and len(set(text)) > n // 2  # the text itself does not repeat
    copy_prompt = torch.cat([start, torch.tensor(text), start])
    plain = speculative_generate(target, start, PromptLookupProposer(), 4, n)
    copied = speculative_generate(target, copy_prompt, PromptLookupProposer(), 4, n)
    assert copied.tokens == text  # lossless, and the target indeed copies
    assert metrics.tau(copied.rounds) > 1.5
    assert metrics.tau(copied.rounds) > metrics.tau(plain.rounds)


def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    proposer = PromptLookupProposer(max_ngram=2)
    tokens = torch.tensor([5, 6, 7, 8, 1, 5, 6, 9, 2, 3, 5, 6])
    tree = proposer.propose(ProposalContext(tokens=tokens, k=3, vocab_size=10))
    assert tree.tokens.tolist() == [9, 2, 3]  # the latest earlier "5 6" is followed by 9 2 3
    assert proposer.propose(ProposalContext(tokens=torch.tensor([1, 2, 3]), k=3, vocab_size=10)).num_nodes == 0


def test_metrics_against_hand_computed_values() -> None:
    rounds = [
        RoundStats(3, 3, 3, 4, 0),
        RoundStats(3, 3, 1, 2, 4),
        RoundStats(3, 3, 0, 1, 6),
        RoundStats(2, 2, 2, 3, 7),
    ]
    assert metrics.tau(rounds) == 10 / 4
    assert metrics.acceptance_per_position(rounds, 3) == [3 / 4, 2 / 4, 1 / 3]
    assert metrics.acceptance_rate(rounds) == 6 / 11
    assert metrics.expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert metrics.leviathan_speedup(0.5, 3, 0.1) == pytest.approx(1.875 / 1.3)
    assert metrics.expected_tokens(1.0, 4) == 5
    assert math.isnan(metrics.tau([]))


def test_loop_mask() -> None:
    looped = [1, 2, 3] * 6  # period 3, 18 tokens
    assert metrics.loop_mask(looped) == [True] * 18
    distinct = list(range(20))
    assert metrics.loop_share(distinct) == 0.0
    mixed = list(range(100, 110)) + [7, 8] * 8  # 10 distinct tokens, then a period-2 loop of 16 tokens
    mask = metrics.loop_mask(mixed)
    assert mask == [False] * 10 + [True] * 16
    assert metrics.loop_share([4, 5] * 4 + list(range(9))) == 0.0  # shorter than the window: not a loop
    inside, outside = metrics.split_rounds_by_loop([RoundStats(1, 1, 1, 2, 0), RoundStats(1, 1, 0, 1, 12)], mask)
    assert len(inside) == 1 and inside[0].start == 12 and outside[0].start == 0
