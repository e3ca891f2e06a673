"""Sliding windows and document masks in the drafters' attention (trainer/models/documents.py's convention): each
attention against a mask written out by loops, the flex path against the dense one, a window at least the row's length
against no window, training against drafting, export against reload."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.test_eagle3_drafter import small_drafter
from tests.unit.test_eagle3_export import logits_of
from trainer.decoding.generate import speculative_generate
from trainer.decoding.proposers import NoProposer
from trainer.interface.errors import RecipeError, UsageError
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


# ---- DFlash's anchored blocks -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("window", "packed"), [(None, False), (3, False), (None, True), (4, True)])
def test_anchored_attention_applies_the_window_and_the_documents_of_a_naive_mask(window, packed):
    from trainer.models.block_attention import anchored_block_attention, anchored_block_mask

    torch.manual_seed(1)
    B, nh, nkv, S, N, b, D = 2, 4, 2, 20, 3, 4, 8
    documents = documents_of([6, 9, 5], B) if packed else None
    q = torch.randn(B, nh, N * b, D, dtype=torch.float64)
    k_ctx, v_ctx, k_blk, v_blk = (torch.randn(B, nkv, n, D, dtype=torch.float64) for n in (S, S, N * b, N * b))
    anchors = torch.tensor([[0, 7, 19], [3, 6, 12]])
    allowed = torch.zeros(B, N * b, S + N * b, dtype=torch.bool)  # block j: context a_j - window .. a_j - 1
    for r in range(B):
        for j in range(N):
            a = int(anchors[r, j])
            for s in range(b):
                for c in range(a):
                    same = documents is None or bool(documents[r, c] == documents[r, a])
                    allowed[r, j * b + s, c] = (window is None or c >= a - window) and same
                allowed[r, j * b + s, S + j * b : S + (j + 1) * b] = True
    assert torch.equal(anchored_block_mask(anchors, S, b, window, documents), allowed)
    keys = torch.cat([k_ctx, k_blk], 2).repeat_interleave(2, 1)
    values = torch.cat([v_ctx, v_blk], 2).repeat_interleave(2, 1)
    naive = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None])
    dense = anchored_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, b, "dense", window, documents)
    torch.testing.assert_close(dense, naive, rtol=1e-12, atol=1e-12)
    args = [t.float() for t in (q, k_ctx, v_ctx, k_blk, v_blk)]
    flex = anchored_block_attention(*args, anchors, b, "flex", window, documents)  # uncompiled forward on CPU
    torch.testing.assert_close(flex.double(), naive, rtol=1e-5, atol=1e-5)


def windowed_dflash(drafter, window: int):
    """``drafter`` with every layer a non-causal sliding one of ``window`` (what ``model.window`` sets)."""
    c = drafter.config
    c.layer_types, c.sliding_window, c.sliding_window_non_causal = (
        ("sliding_attention",) * c.num_hidden_layers,
        window,
        True,
    )
    return drafter


def test_windowed_training_blocks_equal_drafting_each_block_alone_and_a_long_window_changes_nothing():
    from tests.unit.test_dflash_drafter import small_drafter as small_dflash

    drafter = small_dflash(2)
    embedding = torch.nn.Embedding(50, 16)
    B, S, b = 2, 12, 4
    context = drafter.context([torch.randn(B, S, 16) for _ in range(2)])  # [B, S, H]
    anchors = torch.tensor([[0, 5, 10], [1, 3, 11]])
    block_ids = drafter.block_ids(torch.randint(0, 48, (B, S)).gather(1, anchors))  # [B, N * b]
    with torch.no_grad():
        full = drafter.train_blocks(context, embedding(block_ids), anchors, "dense")
        for window in (S, S + 7):  # every context position stays inside: exactly the full layers' outputs
            assert torch.equal(windowed_dflash(drafter, window).train_blocks(context, embedding(block_ids), anchors,
                                                                             "dense"), full)  # fmt: skip
        out = windowed_dflash(drafter, 3).train_blocks(context, embedding(block_ids), anchors, "dense")
        assert not torch.allclose(out, full, atol=1e-4)
        for r in range(B):
            for j in range(3):
                a = int(anchors[r, j])
                past = drafter.context_kv(context[r : r + 1, :a], torch.arange(a)[None])
                block = embedding(block_ids[r : r + 1, j * b : (j + 1) * b])  # [1, b, H]
                alone = drafter.draft(block, torch.arange(a, a + b)[None], past)
                torch.testing.assert_close(out[r : r + 1, j * b : (j + 1) * b], alone, rtol=1e-5, atol=1e-5)


def test_windowed_dflash_decoding_is_the_targets_greedy_output_and_drafts_the_training_blocks():
    from tests.unit.test_dflash_proposer import Recording, setup
    from trainer.methods.dflash.proposer import DFlashTreeProposer

    target, drafter = setup(1)
    windowed_dflash(drafter, 4)
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    prompt = torch.randint(0, 127, (11,), generator=torch.Generator().manual_seed(1))
    alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=24).tokens
    chain = Recording(drafter, embedding, head)
    for proposer in (chain, DFlashTreeProposer(drafter, embedding, head, top_k=3, budget=10)):
        assert speculative_generate(target, prompt, proposer, k=4, max_new_tokens=24).tokens == alone
    for tokens, logits in chain.rounds:
        T = tokens.numel()
        with torch.no_grad():
            hidden = target(tokens[None], output_hidden_states=True).hidden_states
            context = drafter.context([hidden[i] for i in drafter.config.target_layers])  # [1, T, H]
            block = drafter.block_ids(tokens[-1:])[None]  # [1, b]
            out = drafter.train_blocks(context, embedding[block], torch.tensor([[T - 1]]), "dense")  # [1, b, H]
        torch.testing.assert_close(logits, out[0, 1:] @ head.t(), rtol=1e-6, atol=1e-6)


def test_dflash_speculators_export_keeps_the_window(tmp_path):
    from tests.unit.test_dflash_drafter import small_drafter as small_dflash
    from tests.unit.test_dflash_export import draft_logits
    from trainer.methods.dflash import export as dflash_formats

    drafter = windowed_dflash(small_dflash(4), 3).eval()
    out = dflash_formats.save_speculators(drafter, str(tmp_path / "spec"), verifier="some/target")
    config = json.loads((out / "config.json").read_text())
    layer = config["transformer_layer_config"]
    assert (layer["layer_types"], layer["sliding_window"]) == (["sliding_attention"] * 2, 3)
    assert config["sliding_window_non_causal"] is True
    reloaded = dflash_formats.load_speculators(str(out))
    assert reloaded.config == drafter.config
    torch.testing.assert_close(draft_logits(reloaded), draft_logits(drafter), rtol=0, atol=0)


def test_dflash_refuses_a_bad_window_naming_the_key():
    from trainer.methods.dflash.objective import DFlash

    with pytest.raises(RecipeError, match=r"model\.window=0"):
        DFlash(target="never-loaded", window=0)
