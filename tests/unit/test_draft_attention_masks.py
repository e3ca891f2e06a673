"""Sliding windows and document masks in the drafters' attention (trainer/documents.py's convention): each attention
against a mask written out by loops, the flex path against the dense one, a window at least the row's length against
no window, training against drafting, export against reload."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.test_eagle3_drafter import small_drafter
from tests.unit.test_eagle3_export import logits_of
from trainer.decoding.generate import speculative_generate
from trainer.decoding.proposers import NoProposer
from trainer.errors import RecipeError, UsageError
from trainer.methods.eagle3.export import load_speculators, save_native, save_speculators
from trainer.methods.eagle3.module import masked_attention, ttt_attention, ttt_mask
from trainer.methods.eagle3.objective import Eagle3
from trainer.methods.eagle3.proposer import Eagle3Proposer, Eagle3TreeProposer
from trainer.methods.peagle.objective import PEagle

pytestmark = pytest.mark.usefixtures("one_thread")


def documents_of(lengths: list[int], rows: int = 1) -> torch.Tensor:
    """[rows, sum(lengths)] document ids of rows made of documents of the given lengths."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).expand(rows, -1)


def naive_ttt_mask(S: int, step: int, window: int | None, documents: torch.Tensor | None) -> torch.Tensor:
    """[B, S, (step + 1) S] the TTT mask element by element: query t of step ``step`` sits at position t + step; the
    step-0 key s at s (causal, same document), the step-j key of element t at t + j."""
    B = 1 if documents is None else documents.shape[0]
    allowed = torch.zeros(B, S, S * (step + 1), dtype=torch.bool)
    for b in range(B):
        for t in range(S):
            for j in range(step + 1):
                for s in range(S):
                    key = s if j == 0 else t + j
                    ok = (s <= t) if j == 0 else (s == t)
                    ok = ok and (window is None or (t + step) - key < window)
                    if j == 0 and documents is not None:
                        ok = ok and bool(documents[b, s] == documents[b, t])
                    allowed[b, t, j * S + s] = ok
    return allowed


# ---- EAGLE-3's training-time test ---------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 1, 2, 4])
@pytest.mark.parametrize("step", [0, 1, 3])
@pytest.mark.parametrize("packed", [False, True])
def test_ttt_attention_applies_the_window_and_the_documents_of_a_naive_mask(step, window, packed):
    torch.manual_seed(step)
    B, nh, nkv, S, D = 2, 4, 2, 7, 8
    documents = documents_of([3, 4], B) if packed else None
    q = torch.randn(B, nh, S, D, dtype=torch.float64)
    keys = [torch.randn(B, nkv, S, D, dtype=torch.float64) for _ in range(step + 1)]
    values = [torch.randn(B, nkv, S, D, dtype=torch.float64) for _ in range(step + 1)]
    allowed = naive_ttt_mask(S, step, window, documents)  # [B', S, K]
    assert torch.equal(ttt_mask(S, step, window=window, documents=documents).expand_as(allowed), allowed)
    naive = masked_attention(q, torch.cat(keys, 2), torch.cat(values, 2), allowed[:, None])
    torch.testing.assert_close(ttt_attention(q, keys, values, "dense", window, documents), naive)


@pytest.mark.parametrize(("window", "packed"), [(3, False), (None, True), (5, True)])
def test_ttt_flex_attention_matches_the_dense_one_with_window_and_documents(window, packed):
    """flex's uncompiled forward runs on CPU (its backward does not): the same mask as the dense path."""
    torch.manual_seed(0)
    B, nh, nkv, S, D = 2, 4, 2, 24, 8
    documents = documents_of([10, 5, 9], B) if packed else None
    q = torch.randn(B, nh, S, D)
    keys = [torch.randn(B, nkv, S, D) for _ in range(4)]
    values = [torch.randn(B, nkv, S, D) for _ in range(4)]
    for i in range(1, 5):
        flex = ttt_attention(q, keys[:i], values[:i], "flex", window, documents)
        dense = ttt_attention(q, keys[:i], values[:i], "dense", window, documents)
        torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_a_window_at_least_the_row_gives_exactly_the_logits_of_none():
    drafter, embedding = small_drafter(3)
    S, K = 6, 3
    full = logits_of(drafter, embedding)  # [K, B, S, Vd], window None
    for window in (S + K, S + K + 5):
        drafter.config.window = window
        assert torch.equal(logits_of(drafter, embedding), full)
    drafter.config.window = 2
    assert not torch.allclose(logits_of(drafter, embedding), full)


@pytest.mark.parametrize("window", [1, 2, 3])
def test_every_windowed_ttt_step_equals_the_proposers_chain_drafting(window):
    """Element t at step i of the unroll (fed its own argmax) is exactly the draft of depth i + 1 that the chain
    proposer makes after committing tokens 0..t + 1: training and drafting see the same keys."""
    drafter, embedding = small_drafter(4, target_hidden=12)
    drafter.config.window = window
    S, K = 9, 4
    aux = [torch.randn(1, S, 12, dtype=torch.float64) for _ in drafter.config.aux_layers]
    stream = torch.randint(0, 50, (S + 1,))
    unrolled = list(drafter.unroll(embedding, drafter.fuse(aux), stream[None, 1:], K))  # K x [1, S, Vd]
    for t in range(S):
        proposer = Eagle3Proposer(drafter, embedding)
        context = proposer_context(stream[: t + 2], {i: h[0, : t + 1] for i, h in zip(drafter.config.aux_layers, aux)})
        drafts = proposer.propose(context).tokens
        trained = torch.stack([drafter.to_target_ids(logits[0, t].argmax()) for logits in unrolled])
        assert torch.equal(drafts, trained), (t, drafts, trained)


def proposer_context(tokens: torch.Tensor, hidden: dict[int, torch.Tensor], k: int = 4):
    from trainer.decoding.proposers import ProposalContext

    return ProposalContext(tokens=tokens, k=k, vocab_size=50, hidden_states=hidden)


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_windowed_speculative_decoding_is_the_targets_greedy_output(kind):
    from tests.unit.test_eagle3_proposer import target_and_drafter

    target, drafter = target_and_drafter(0)
    drafter.config.window = 3
    embedding = target.get_input_embeddings()
    if kind == "chain":
        proposer = Eagle3Proposer(drafter, embedding)
    else:
        proposer = Eagle3TreeProposer(drafter, embedding, top_k=3, budget=10)
    prompt = torch.randint(0, 96, (12,))
    alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=24)
    for k in (1, 4):
        assert speculative_generate(target, prompt, proposer, k=k, max_new_tokens=24).tokens == alone.tokens


def test_speculators_export_carries_the_window_and_reloads_it(tmp_path):
    drafter, embedding = small_drafter(5, target_hidden=16)
    drafter.config.window = 3
    save_speculators(drafter, str(tmp_path), verifier="some/target", embedding=embedding.weight, speculative_tokens=3)
    layer = json.loads((tmp_path / "config.json").read_text())["transformer_layer_config"]
    assert (layer["sliding_window"], layer["layer_types"]) == (3, ["sliding_attention"])
    reloaded = load_speculators(str(tmp_path)).double()
    assert reloaded.config.window == 3
    assert torch.equal(logits_of(reloaded, embedding), logits_of(drafter, embedding))
    with pytest.raises(UsageError, match="native eagle3 format cannot express a sliding window"):
        save_native(drafter, str(tmp_path / "native"))


def test_an_unwindowed_export_writes_no_window_keys(tmp_path):
    drafter, embedding = small_drafter(5, target_hidden=16)
    save_speculators(drafter, str(tmp_path), verifier="some/target", embedding=embedding.weight, speculative_tokens=3)
    layer = json.loads((tmp_path / "config.json").read_text())["transformer_layer_config"]
    assert "sliding_window" not in layer and "layer_types" not in layer
    assert load_speculators(str(tmp_path)).config.window is None


@pytest.mark.parametrize("objective", [Eagle3, PEagle])
@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_a_bad_window_is_refused_naming_the_key(objective, window):
    with pytest.raises(RecipeError, match=r"model\.window="):
        objective(target="never-loaded", window=window)
