"""P-EAGLE: COD sampling, the cross-depth mask against its definition (dense and flex), every trained element against
drafting as the proposer does it, the loss against a naive per-element formula, lossless drafting (greedy identity
and speculative sampling), K drafts in one forward, the export round trip and the refusals."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from tests.helpers import tiny_llama
from tests.integration.test_eagle3_offline import tiny_llama as saved_llama
from trainer.decoding.generate import speculative_generate
from trainer.decoding.head_tree import MEDUSA_SPARSE_TREE
from trainer.decoding.proposers import NoProposer, ProposalContext
from trainer.interface.errors import ModelFolderError, RecipeError
from trainer.methods.eagle3.module import Eagle3Config
from trainer.methods.eagle3.objective import Eagle3
from trainer.methods.eagle3.vocab_map import build_vocab_map
from trainer.methods.peagle.export import load_peagle, save_peagle
from trainer.methods.peagle.module import PEagleConfig, PEagleDrafter, peagle_mask, peagle_mask_mod
from trainer.methods.peagle.objective import PEagle, cod_sample
from trainer.methods.peagle.proposer import PEagleProposer
from trainer.training.registry import load_drafter, recognise

pytestmark = pytest.mark.usefixtures("one_thread")


def drafter_for(target, seed: int = 0, draft_vocab: int | None = None, num_layers: int = 1, **flags) -> PEagleDrafter:
    """A random float64 P-EAGLE drafter over ``target`` (norms and placeholders non-trivial)."""
    torch.manual_seed(seed)
    vocab = target.config.vocab_size
    base = Eagle3Config.from_target(target.config, draft_vocab or vocab // 2, **flags)
    config = PEagleConfig(**base.to_dict(), mask_token_id=vocab - 1, num_layers=num_layers)
    drafter = PEagleDrafter(config).double()
    for name, p in drafter.named_parameters():
        if "norm" in name:
            nn.init.normal_(p, mean=1.0, std=0.3)
    drafter.set_vocab_map(*build_vocab_map(torch.randint(0, 50, (vocab,)), base.draft_vocab_size))
    return drafter


def test_cod_sampling_nests_depths_and_keeps_the_ratio():
    g = torch.Generator().manual_seed(0)
    trained = torch.rand(41, generator=g) < 0.8  # label positions 1..41 of 40 elements
    parts = cod_sample(trained, depths=5, ratio=0.5, floor=0.1, generator=g)
    base = int(trained[:40].sum())
    assert torch.equal(parts[0][0], torch.arange(40)) and bool((parts[0][1] == 0).all())
    for d in range(1, len(parts)):
        anchors, depth = parts[d]
        assert bool((depth == d).all())
        assert set(anchors.tolist()) <= set(parts[d - 1][0].tolist())  # a whole rollout before every placeholder
        assert all(a + d <= 39 and bool(trained[a + d]) for a in anchors.tolist())
        candidates = [a for a in parts[d - 1][0].tolist() if a + d <= 39 and trained[a + d]]
        assert anchors.numel() == min(len(candidates), int(base * max(0.5**d, 0.1)))
    full = cod_sample(trained, depths=3, ratio=1.0, floor=0.0)  # r = 1: every trained rollout, every depth
    assert full[1][0].tolist() == [a for a in range(39) if trained[a + 1]]
    # max_anchors: the deeper depths come from at most that many anchors with a trained depth-0 label
    capped = cod_sample(trained, depths=5, ratio=0.5, floor=0.1, generator=g, max_anchors=7)
    assert torch.equal(capped[0][0], torch.arange(40))
    seeds = set(capped[1][0].tolist())
    for d in range(1, len(capped)):
        anchors = capped[d][0]
        assert set(anchors.tolist()) <= seeds and all(bool(trained[a]) for a in anchors.tolist())
        assert anchors.numel() <= int(7 * max(0.5**d, 0.1))
        if d > 1:
            assert set(anchors.tolist()) <= set(capped[d - 1][0].tolist())
    assert 0 < capped[1][0].numel() <= int(7 * 0.5)
    uncapped = cod_sample(trained, depths=2, ratio=1.0, floor=0.0, max_anchors=base)  # a cap at n_trained: no cap
    assert uncapped[1][0].tolist() == full[1][0].tolist()


def test_mask_matches_its_definition_and_flex_matches_dense():
    anchor = torch.tensor([[0, 1, 2, 3, 4, 0, 2, 3, 2, 0], [0, 1, 2, 3, 1, 1, 2, 0, 0, 0]])
    depth = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2, 3], [0, 0, 0, 0, 1, 2, 1, 0, 0, 0]])
    valid = torch.tensor([[True] * 10, [True] * 7 + [False] * 3])
    for window in (None, 2):
        allowed = peagle_mask(anchor, depth, valid, window)[:, 0]
        for b in range(2):
            for q in range(10):
                for k in range(10):
                    aq, ak, dq, dk = (int(x) for x in (anchor[b, q], anchor[b, k], depth[b, q], depth[b, k]))
                    rule = (dk == 0 and ak <= aq) or (ak == aq and dk <= dq)
                    rule = rule and (window is None or (aq + dq) - (ak + dk) < window)
                    expected = (rule and bool(valid[b, q]) and bool(valid[b, k])) or q == k
                    assert bool(allowed[b, q, k]) == expected, (b, q, k)
    from trainer.methods.eagle3.module import masked_attention
    from trainer.models.block_attention import flex_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    for window in (None, 2):
        flex = flex_attention(q, k, v, peagle_mask_mod(anchor, depth, valid, window), 2)  # uncompiled on CPU
        dense = masked_attention(q, k, v, peagle_mask(anchor, depth, valid, window))
        torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("num_layers", "window"), [(1, None), (3, None), (3, 3)])
def test_the_split_dense_pass_equals_one_masked_pass_over_every_element_and_flex(num_layers, window):
    """``parallel`` projects the placeholders once and splits the attention (causal depth-0 block, masked
    placeholders): the same logits as projecting every element and attending under the whole mask in every layer, and
    as flex (with a sliding window too); elements out of COD sampling's order are refused."""
    from trainer.methods.eagle3.module import masked_attention

    target = tiny_llama(seed=3)
    drafter = drafter_for(target, seed=4, num_layers=num_layers)
    drafter.config.window = window
    S, K = 12, 4
    trained = torch.ones(2, S + 1, dtype=torch.bool)
    trained[1, 7] = False
    rows = [cod_sample(trained[b, 1:], K, 0.7, 0.2, torch.Generator().manual_seed(b)) for b in range(2)]
    flat = [(torch.cat([a for a, _ in r]), torch.cat([d for _, d in r])) for r in rows]
    N = max(len(a) for a, _ in flat)
    anchor, depth = torch.zeros(2, N, dtype=torch.long), torch.zeros(2, N, dtype=torch.long)
    valid = torch.zeros(2, N, dtype=torch.bool)
    for b, (a, d) in enumerate(flat):
        anchor[b, : len(a)], depth[b, : len(a)], valid[b, : len(a)] = a, d, True
    n = S - 1
    torch.manual_seed(5)
    H = drafter.config.hidden_size
    embeds, hidden = torch.randn(2, n, H, dtype=torch.float64), torch.randn(2, n, H, dtype=torch.float64)
    with torch.no_grad():
        split = drafter.parallel(embeds, hidden, anchor, depth, valid, "dense")
        flex = drafter.parallel(embeds, hidden, anchor, depth, valid, "flex")
        pe, ph = drafter.placeholder(N - n)
        all_embeds = torch.cat([embeds, pe.expand(2, -1, -1)], 1)  # [2, N, H]
        all_hidden = torch.cat([hidden, ph.expand(2, -1, -1)], 1)
        cos, sin = drafter.rope(all_hidden, anchor + depth)
        q, k, v = drafter.midlayer.qkv(all_embeds, all_hidden, cos, sin)
        allowed = peagle_mask(anchor, depth, valid, window)
        h = drafter.midlayer.finish(all_hidden, masked_attention(q, k, v, allowed))
        for layer in drafter.deep_layers:
            h = layer.finish(h, masked_attention(*layer.qkv(h, cos, sin), allowed))
        whole = drafter.outputs(h)[1]
    real = valid[..., None].expand_as(split)
    torch.testing.assert_close(split[real], whole[real], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(flex[real], whole[real], rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="depth-0"):
        drafter.parallel(embeds, hidden, anchor.flip(1), depth.flip(1), valid.flip(1))


def objective(tmp_path, **kwargs) -> PEagle:
    saved_llama(tmp_path / "target", tied=False)  # vocab 64, no tokenizer: mask_token_id must be given
    return PEagle(str(tmp_path / "target"), draft_vocab_size=32, target_layers=[0, 1, 2], mask_token_id=63, **kwargs)


@pytest.mark.parametrize(
    ("loss_mean", "argmax_weight", "num_layers", "window"),
    [("element", 0.0, 1, None), ("depth", 0.0, 1, None), ("element", 0.3, 2, None), ("element", 0.0, 2, 3)],
)
def test_every_trained_element_is_what_drafting_computes_and_the_loss_is_the_naive_one(
    tmp_path, loss_mean, argmax_weight, num_layers, window
):
    """Element (a, d) of the parallel pass equals the last logits of a plain forward over entries 0..a and d
    placeholders (what the proposer runs); the loss is the soft CE of the trained elements (mixed with argmax_weight
    times the CE of the soft label's argmax), weighted 0.8 ** d: one
    mean over all of them (``element``), or the sum over depths of each depth's mean (``depth``)."""
    obj = objective(
        tmp_path,
        num_depths=3,
        cod_ratio=0.8,
        step_decay=0.8,
        loss_mean=loss_mean,
        argmax_weight=argmax_weight,
        num_layers=num_layers,
        window=window,
    )
    assert len(obj.drafter.deep_layers) == num_layers - 1
    rows = torch.randint(0, 60, (2, 10), generator=torch.Generator().manual_seed(1))
    obj.install_vocab_map([(rows.numpy(), (rows > 3).numpy())])
    for p in obj.drafter.parameters():
        nn.init.normal_(p, std=0.3)
    drafter, target = obj.drafter.double(), obj.target
    target.model.double()
    ids, loss_mask = rows[:, :-1], rows[:, 1:] > 3
    with torch.no_grad():
        out = target(ids, hidden_layers=drafter.config.aux_layers)
        aux = torch.cat([h[:, :-1] for h in out.hidden_states], -1).double()  # [B, S - 1, n Ht]
        probs = torch.softmax(out.logits.index_select(-1, drafter.draft_ids()).double(), -1)
        anchor, depth, valid = obj.sample(loss_mask)
        loss, metrics = obj.parallel_loss(ids, loss_mask, aux, probs, out.logits.argmax(-1), anchor, depth, valid)
        B, S = ids.shape
        sums, counts = [0.0] * 3, [0] * 3
        for b in range(B):
            fused = drafter.fuse([h[b : b + 1, :-1].double() for h in out.hidden_states])  # [1, S - 1, H]
            for j in range(int(valid[b].sum())):
                a, d = int(anchor[b, j]), int(depth[b, j])
                embeds = drafter.embed_tokens(ids[b : b + 1, 1 : a + 2])
                hidden = fused[:, : a + 1]
                if d:
                    pe, ph = drafter.placeholder(d)
                    embeds, hidden = torch.cat([embeds, pe], 1), torch.cat([hidden, ph], 1)
                positions = torch.arange(a + 1 + d)[None]
                _, logits, _ = drafter(embeds, hidden, positions)
                lp = a + 1 + d
                if loss_mask[b, lp]:
                    log_q = torch.log_softmax(logits[0, -1], -1)
                    soft, hard = -(probs[b, lp] * log_q).sum(), -log_q[probs[b, lp].argmax()]
                    sums[d] += float((1 - argmax_weight) * soft + argmax_weight * hard)
                    counts[d] += 1
        if loss_mean == "depth":
            expected = sum(0.8**d * sums[d] / counts[d] for d in range(3))
        else:
            expected = sum(0.8**d * sums[d] for d in range(3)) / sum(counts)
    assert counts[0] > counts[1] > counts[2] > 0 and int((depth == 2).sum()) > 0
    torch.testing.assert_close(float(loss), expected, rtol=1e-6, atol=0)
    assert float(metrics["loss_1"]) == pytest.approx(sums[1] / counts[1], rel=1e-6)


def test_peagle_extends_eagle3_and_inherits_what_they_share(tmp_path):
    """P-EAGLE's objective is EAGLE-3's subclass: the init_from check, the target-layer and draft-vocabulary checks and
    the vocabulary map setup are EAGLE-3's methods, not copies; its hyper-parameters are its own signature's."""
    for shared in ("drafter_from_init", "new_config", "norm_flags", "setup", "build_vocab_map", "install_vocab_map"):
        assert getattr(PEagle, shared) is getattr(Eagle3, shared), shared
    obj = objective(tmp_path)
    assert isinstance(obj, Eagle3) and isinstance(obj.drafter, PEagleDrafter)
    assert set(obj.hparams) == set(inspect.signature(PEagle.__init__).parameters) - {"self", "optim"}
    target = str(tmp_path / "target")
    with pytest.raises(RecipeError, match=r"model.target_layers: 5 is outside the target's hidden_states 0..2"):
        PEagle(target, draft_vocab_size=32, target_layers=[0, 1, 5], mask_token_id=63)
    with pytest.raises(RecipeError, match="mutually exclusive"):
        PEagle(target, draft_vocab_size=32, norm_before_fc=True, fc_norm=True, mask_token_id=63)


def test_recipe_values_are_checked(tmp_path):
    saved_llama(tmp_path / "target", tied=False)
    target = str(tmp_path / "target")
    with pytest.raises(RecipeError, match=r"model.cod_ratio must be in \(0, 1\], got 0"):
        PEagle(target, cod_ratio=0.0, mask_token_id=63)
    with pytest.raises(RecipeError, match=r"model.cod_ratio must be in \(0, 1\], got 1.5"):
        PEagle(target, cod_ratio=1.5, mask_token_id=63)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(RecipeError, match=r"model.argmax_weight must be in \[0, 1\], got"):
            PEagle(target, argmax_weight=bad, mask_token_id=63)
    with pytest.raises(RecipeError, match=r"model.num_layers must be >= 1, got 0"):
        PEagle(target, num_layers=0, mask_token_id=63)
    with pytest.raises(RecipeError, match=r"model.max_anchors must be >= 1 \(or null: every trained position\), got 0"):
        PEagle(target, max_anchors=0, mask_token_id=63)
    with pytest.raises(RecipeError, match="model.mask_token_id: the target's tokenizer uses every id") as err:
        PEagle(target, draft_vocab_size=32)
    assert "set model.mask_token_id" in err.value.hint
    with pytest.raises(RecipeError, match="model.mask_token_id 64 is not a token id"):
        PEagle(target, draft_vocab_size=32, mask_token_id=64)


@pytest.mark.parametrize(("seed", "num_layers"), [(0, 1), (1, 1), (2, 3)])
def test_greedy_drafting_is_lossless_and_one_forward_per_round(seed, num_layers):
    target = tiny_llama(seed, 96, layers=4)
    drafter = drafter_for(target, seed, num_layers=num_layers, fc_norm=True)
    calls, rounds = [], []
    drafter.register_forward_hook(lambda *_: calls.append(1))
    proposer = PEagleProposer(drafter, 4)
    propose = proposer.propose
    proposer.propose = lambda ctx: rounds.append(ctx.k) or propose(ctx)
    prompt = torch.randint(0, 95, (12,))
    alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=30)
    for k in (1, 4):
        calls.clear(), rounds.clear()
        spec = speculative_generate(target, prompt, proposer, k=k, max_new_tokens=30)
        assert spec.tokens == alone.tokens
        assert len(calls) == len(rounds) and max(rounds) == k  # the whole chain in one drafter forward per round


@pytest.mark.parametrize("choices", [MEDUSA_SPARSE_TREE, ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))])
def test_tree_drafting_is_lossless_and_one_forward_per_round(choices):
    """A tree of the depths' top-k paths (the Medusa paper's for 4 depths, and a small one) from one forward a round:
    greedy output identical to the target's, and more tokens a round than the chain of the same drafter."""
    target = tiny_llama(2, 96, layers=4)
    drafter = drafter_for(target, 2)
    prompt = torch.randint(0, 95, (12,))
    alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=30)
    calls, rounds = [], []
    drafter.register_forward_hook(lambda *_: calls.append(1))
    proposer = PEagleProposer(drafter, 4, choices)
    propose = proposer.propose
    proposer.propose = lambda ctx: rounds.append(ctx.k) or propose(ctx)
    tree = speculative_generate(target, prompt, proposer, k=4, max_new_tokens=30)
    assert tree.tokens == alone.tokens
    assert len(calls) == len(rounds) > 0 and max(r.nodes for r in tree.rounds) == len(choices)  # one forward a round
    chain = speculative_generate(target, prompt, PEagleProposer(drafter, 4), k=4, max_new_tokens=30)
    assert chain.tokens == alone.tokens and len(tree.rounds) <= len(chain.rounds)


def test_write_tree_measures_the_depths_and_its_tree_drafts_losslessly(tmp_path):
    """``--write_tree``: the depths' top-k accuracy measured on greedy decoding (whose last rounds draft fewer than K,
    the output's budget) gives a tree of the asked nodes, which then drafts the target's own output."""
    target = tiny_llama(5, 96, layers=4)
    drafter = drafter_for(target, 5)
    prompts = [torch.randint(0, 95, (10,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
    paths = PEagleProposer(drafter, 4).write_tree(tmp_path / "tree.json", target, prompts, 13, nodes=6)
    assert len(paths) == 6 and json.loads((tmp_path / "tree.json").read_text())
    prompt = torch.tensor(prompts[0])
    alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=20)
    assert speculative_generate(target, prompt, PEagleProposer(drafter, 4, paths), 4, 20).tokens == alone.tokens


def test_drafts_are_the_depths_argmax_and_sampled_ones_carry_their_distributions():
    target = tiny_llama(3, 96, layers=4)
    drafter = drafter_for(target, 3)
    tokens = torch.randint(0, 95, (15,))
    with torch.no_grad():
        out = target(tokens[None, :-1], output_hidden_states=True)
    hidden = {i: out.hidden_states[i][0] for i in drafter.config.aux_layers}
    tree = PEagleProposer(drafter, 4).propose(ProposalContext(tokens=tokens, k=3, vocab_size=96, hidden_states=hidden))
    with torch.no_grad():  # depth d: a plain forward over the committed entries and d placeholders
        fused = drafter.fuse([hidden[i][None] for i in drafter.config.aux_layers])
        embeds = drafter.embed_tokens(tokens[1:][None])
        pe, ph = drafter.placeholder(2)
        _, logits, _ = drafter(torch.cat([embeds, pe], 1), torch.cat([fused, ph], 1), torch.arange(16)[None])
    assert torch.equal(tree.tokens, drafter.to_target_ids(logits[0, -3:].argmax(-1)))
    g = torch.Generator().manual_seed(0)
    ctx = ProposalContext(tokens=tokens, k=3, temperature=0.7, generator=g, vocab_size=96, hidden_states=hidden)
    sampled = PEagleProposer(drafter, 4).propose(ctx)
    assert sampled.is_chain() and sampled.probs.shape == (3, 96)
    torch.testing.assert_close(sampled.probs.sum(-1), torch.ones(3, dtype=sampled.probs.dtype))
    assert bool((sampled.probs[:, ~drafter.t2d] == 0).all()) and bool(
        (sampled.probs[range(3), sampled.tokens] > 0).all()
    )


@pytest.mark.slow
def test_speculative_sampling_with_peagle_is_distributed_as_the_target():
    from tests.unit.test_decoding_sampling import chi_square_p, exact_joint
    from tests.unit.test_decoding_sampling import tiny_llama as sampling_llama

    vocab, length, n = 5, 3, 600
    target = sampling_llama(0, vocab, scale=8.0)
    drafter = drafter_for(target, 1, draft_vocab=4)  # a reduced draft vocabulary: one token never drafted
    with torch.no_grad():
        drafter.lm_head.weight.mul_(10.0)  # sharp drafts unlike the target
    prompt = torch.tensor([1, 2, 3, 0])
    expected = exact_joint(target, prompt, length, 1.0) * n
    counts = torch.zeros([vocab] * length)
    gen = torch.Generator().manual_seed(0)
    proposer = PEagleProposer(drafter, 4)
    for _ in range(n):
        result = speculative_generate(target, prompt, proposer, 2, length, 1.0, generator=gen)
        counts[tuple(result.tokens)] += 1
    assert chi_square_p(counts, expected) > 1e-3


@pytest.mark.parametrize("num_layers", [1, 3])
def test_export_round_trip_and_refusals(tmp_path, num_layers):
    """Every tensor back under its name (decoder layer j as ``layers.{j}.*``), the same drafts, and the refusals."""
    target = tiny_llama(4, 96, layers=4)
    drafter = drafter_for(target, 4, num_layers=num_layers, norm_before_fc=True)
    save_peagle(drafter, str(tmp_path / "export"), verifier="some/target", speculative_tokens=4)
    kind, fmt = recognise(tmp_path / "export")
    assert (kind.name, fmt.name) == ("peagle", "peagle-speculators")
    reloaded, record = load_drafter(str(tmp_path / "export"))
    assert record.draft_tokens == 4 and reloaded.config == drafter.config
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleSpeculator"]
    assert config["mask_token_id"] == 95 and config["norm_before_fc"] is True
    assert config["transformer_layer_config"]["num_hidden_layers"] == num_layers
    names = safe_open(tmp_path / "export" / "model.safetensors", "pt").keys()
    assert {n.split(".")[1] for n in names if n.startswith("layers.")} == {str(j) for j in range(num_layers)}
    for key, value in drafter.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[key], value, rtol=0, atol=0)
    tokens = torch.randint(0, 95, (15,))
    with torch.no_grad():
        out = target(tokens[None, :-1], output_hidden_states=True)
    hidden = {i: out.hidden_states[i][0] for i in drafter.config.aux_layers}
    for model in (drafter, reloaded.double()):
        ctx = ProposalContext(tokens=tokens, k=4, vocab_size=96, hidden_states=hidden)
        ours, reference = PEagleProposer(model, 4).propose(ctx), PEagleProposer(drafter, 4).propose(ctx)
        assert ours.tokens.tolist() == reference.tokens.tolist()
    config["mask_token_id"] = None
    (tmp_path / "export" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match="mask_token_id must be a token id"):
        load_peagle(str(tmp_path / "export"))
    config["mask_token_id"] = 95
    config["transformer_layer_config"]["num_hidden_layers"] = 0
    (tmp_path / "export" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match=r"transformer_layer_config.num_hidden_layers must be >= 1, got 0"):
        load_peagle(str(tmp_path / "export"))
