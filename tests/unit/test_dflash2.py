"""DFlash2, DFlash's block refiner (trainer/methods/dflash2/): the convolution against a loop over taps, identity
convolutions computing DFlash's slots, the loss against a naive reference (each block drafted alone, the unary slot
loss plus the selector's cross entropy over the top-k candidates given the data's previous token), chain and tree
drafting lossless and resolved left to right through the selector, the ``dflash2`` export reloaded with identical
logits, bad input refused naming the value, ``init_from`` a DFlash drafter, and the recipe and compare row."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from tests.helpers import tiny_llama
from tests.unit.test_dflash_objective import V, save_target
from trainer.decoding.generate import speculative_generate
from trainer.decoding.proposers import NoProposer, ProposalContext
from trainer.interface.errors import ModelFolderError, RecipeError, UsageError
from trainer.methods.dflash import kind as dflash_kind
from trainer.methods.dflash.module import DFlashConfig, DFlashDrafter
from trainer.methods.dflash.objective import DFlash
from trainer.methods.dflash2 import kind as dflash2_kind
from trainer.methods.dflash2.conv import block_conv
from trainer.methods.dflash2.module import DFLASH2_KEYS, DFlash2Config, DFlash2Drafter
from trainer.methods.dflash2.objective import DFlash2
from trainer.methods.dflash2.proposer import DFlash2Proposer, DFlash2TreeProposer
from trainer.training.recipe import parse_recipe
from trainer.training.registry import get_kind

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(conv_kernel_size=2, conv_group_size=4, selector_rank=5, selector_top_k=4)


def setup(seed: int = 0, **fields) -> tuple[nn.Module, DFlash2Drafter]:
    """The unit tests' tiny target (float64) and a DFlash2 drafter with random weights (convolutions included)."""
    target = tiny_llama(seed, vocab=128, layers=4)  # float64, eval
    config = DFlashConfig.from_target(target.config, 2, (1, 3), block_size=5, mask_token_id=127)
    config = DFlash2Config(**{**config.to_dict(), **SMALL, "conv_group_size": 8, **fields})
    torch.manual_seed(seed)
    drafter = DFlash2Drafter(config)
    for p in drafter.parameters():
        nn.init.normal_(p, std=0.3)
    return target, drafter.to(torch.float64).eval()


def test_the_convolution_equals_a_loop_over_taps_inside_each_block():
    g = torch.Generator().manual_seed(0)
    B, b, blocks, H, G, K = 2, 4, 3, 6, 3, 3
    x = torch.randn(B, blocks * b, H, dtype=torch.float64, generator=g)
    delta = torch.randn(B, blocks * b, K, G, dtype=torch.float64, generator=g)
    base = torch.randn(K, H, dtype=torch.float64, generator=g)
    out = block_conv(x, delta, base, b)
    expected = torch.zeros_like(x)
    for r in range(B):
        for q in range(blocks * b):
            for tap in range(min(K, q % b + 1)):  # never into the block before
                groups = delta[r, q, tap].repeat_interleave(H // G)  # [H]: each group's tap on its channels
                expected[r, q] += x[r, q - tap] * (base[tap] + groups)
    torch.testing.assert_close(out, expected)


def test_identity_convolutions_compute_dflash_slots_and_training_equals_drafting():
    target, drafter = setup()
    c = drafter.config
    fresh = DFlash2Drafter(c).double()  # convolutions at their initialisation: the identity
    plain = DFlashDrafter(DFlashConfig(**{k: v for k, v in c.to_dict().items() if k not in DFLASH2_KEYS}))
    plain.double().load_state_dict({k: v for k, v in fresh.state_dict().items() if not fresh.is_refiner_weight(k)})
    hidden = [torch.randn(2, 14, 32, dtype=torch.float64) for _ in c.target_layers]
    embeds = torch.randn(2, 3 * 5, 32, dtype=torch.float64)
    anchors = torch.tensor([[0, 4, 8], [1, 2, 6]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(hidden, embeds, anchors, "dense"), plain(hidden, embeds, anchors, "dense"))
        slots = drafter(hidden, embeds, anchors, "dense")  # random convolutions: each block drafted alone agrees
        context = drafter.context(hidden)
        for r in range(2):
            for j in range(3):
                a = int(anchors[r, j])
                past = drafter.context_kv(context[r : r + 1, :a], torch.arange(a)[None])
                alone = drafter.draft(embeds[r : r + 1, j * 5 : j * 5 + 5], torch.arange(a, a + 5)[None], past)
                torch.testing.assert_close(alone[0], slots[r, j * 5 : j * 5 + 5])


def naive_dflash2_loss(objective: DFlash2, ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[float, float]:
    """(total loss, selector loss): each block drafted alone; slot k's cross entropy of the data's token and the
    selector's cross entropy over its top-k unary candidates (the last replaced by the data's token when missing) of
    their unary logits plus sum_r P[prev, r] (W h)_r S[c, r], prev the data's token before; both weighted
    exp(-(k - 1) / gamma), normalised by the weights; total = unary + alpha * selector."""
    drafter, target = objective.drafter, objective.target
    c, sel = drafter.config, objective.drafter.candidate_selector
    b, (B, S) = c.block_size, ids.shape
    trained = F.pad(loss_mask[:, :-1], (1, 0), value=False)
    anchors, keep = objective.anchors(trained, "train")
    out = target.model(ids, output_hidden_states=True)
    head, embedding = target.lm_head_weight, objective.embedding_weight()
    unary = selector = weights = 0.0
    for r in range(B):
        context = drafter.context([out.hidden_states[i][r : r + 1] for i in c.target_layers])
        for j in range(anchors.shape[1]):
            if not keep[r, j]:
                continue
            a = int(anchors[r, j])
            past = drafter.context_kv(context[:, :a], torch.arange(a)[None])
            block = torch.tensor([[int(ids[r, a])] + [c.mask_token_id] * (b - 1)])
            slots = drafter.draft(F.embedding(block, embedding), torch.arange(a, a + b)[None], past)[0]  # [b, H]
            for k in range(1, b):
                p = a + k
                if p >= S or not trained[r, p]:
                    continue
                token, prev = int(ids[r, p]), int(ids[r, p - 1])
                logits = slots[k] @ head.t()  # [V]
                w = math.exp(-(k - 1) / objective.gamma)
                unary += w * float(F.cross_entropy(logits[None], ids[r, p][None]))
                candidates = logits.topk(c.selector_top_k).indices.tolist()
                if token not in candidates:
                    candidates[-1] = token
                bilinear = sel.predecessor_codebook[prev] * (sel.hidden_projection.weight @ slots[k])  # [r]
                scores = torch.stack([logits[v] + bilinear @ sel.successor_codebook[v] for v in candidates])
                selector += w * float(F.cross_entropy(scores[None], torch.tensor([candidates.index(token)])))
                weights += w
    return (unary + objective.selector_alpha * selector) / weights, selector / weights


def test_the_loss_equals_blocks_drafted_alone_with_the_selector(tmp_path):
    save_target(tmp_path / "target")
    objective = DFlash2(
        str(tmp_path / "target"), num_draft_layers=1, target_layers=[1, 3], block_size=4, mask_token_id=V - 1,
        max_anchors=3, labels="data", loss_chunk_size=4, selector_loss_alpha=0.7, **SMALL,
    )  # fmt: skip
    for p in objective.drafter.parameters():
        nn.init.normal_(p, std=0.3)
    ids = torch.randint(0, V - 1, (2, 11), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.ones(2, 11, dtype=torch.bool)
    loss_mask[0, :4] = False
    with torch.no_grad():
        loss, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
        expected, selector_loss = naive_dflash2_loss(objective, ids, loss_mask)
    torch.testing.assert_close(float(loss), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(float(metrics["selector_loss"]), selector_loss, rtol=1e-5, atol=0)
    assert 0.0 <= float(metrics["candidate_recall"]) <= 1.0 and "selector_acc" in metrics
    loss, _ = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
    loss.backward()  # the convolutions and the selector train
    drafter = objective.drafter
    trained = (drafter.candidate_selector.predecessor_codebook, drafter.candidate_selector.successor_codebook,
               drafter.candidate_selector.hidden_projection.weight, drafter.layers[0].attention_conv.base_kernel,
               drafter.layers[0].mlp_conv.kernel_projection.weight)  # fmt: skip
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained)


@pytest.mark.parametrize("labels", ["argmax", "soft"])
def test_dpace_and_target_labels_train_every_part(labels, tmp_path):
    """D-PACE weights (of the selector's own losses for the selector) with argmax labels, the decay with soft ones:
    a finite loss whose gradient reaches the convolutions and the selector."""
    save_target(tmp_path / "target")
    weights = "dpace" if labels == "argmax" else "decay"
    objective = DFlash2(
        str(tmp_path / "target"), num_draft_layers=1, target_layers=[1, 3], block_size=4, mask_token_id=V - 1,
        max_anchors=3, labels=labels, position_weights=weights, loss_chunk_size=4, **SMALL,
    )  # fmt: skip
    for p in objective.drafter.parameters():
        nn.init.normal_(p, std=0.3)
    ids = torch.randint(0, V - 1, (2, 11), generator=torch.Generator().manual_seed(2))
    loss, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": torch.ones(2, 11, dtype=torch.bool)})
    assert torch.isfinite(loss) and float(metrics["selector_loss"]) > 0
    loss.backward()
    selector = objective.drafter.candidate_selector
    assert selector.successor_codebook.grad.abs().sum() > 0
    assert objective.drafter.layers[0].mlp_conv.base_kernel.grad.abs().sum() > 0


def test_chains_and_trees_are_lossless_and_follow_the_selectors_greedy_path(one_thread):
    target, drafter = setup()
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    prompt = torch.randint(0, 127, (11,), generator=torch.Generator().manual_seed(0))
    alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=30).tokens
    chain = DFlash2Proposer(drafter, embedding, head)
    for proposer in (chain, DFlash2TreeProposer(drafter, embedding, head, top_k=3, budget=10)):
        assert speculative_generate(target, prompt, proposer, k=4, max_new_tokens=30).tokens == alone
    # one round by hand: slot k's draft is its best top-k candidate given slot k - 1's draft
    hidden = {i: torch.randn(6, 32, dtype=torch.float64) for i in drafter.config.target_layers}
    chain.reset()
    tokens = torch.tensor([5, 9, 17, 4, 60, 33, 2])
    drafts = chain.propose(ProposalContext(tokens=tokens, k=4, vocab_size=128, hidden_states=hidden)).tokens
    base = chain.slot_hidden @ head.t()  # [b - 1, V]
    sel = drafter.candidate_selector
    prev, expected = int(tokens[-1]), []
    for k in range(4):
        candidates = base[k].topk(drafter.config.selector_top_k).indices
        bilinear = sel.predecessor_codebook[prev] * (sel.hidden_projection.weight @ chain.slot_hidden[k])
        scores = base[k][candidates] + sel.successor_codebook[candidates] @ bilinear
        prev = int(candidates[scores.argmax()])
        expected.append(prev)
    assert drafts.tolist() == expected
    assert base[:4].argmax(-1).tolist() != expected  # the selector changes the drafts (else the check is void)


def test_sampled_chains_draw_from_the_candidates_given_the_drafts_before(one_thread):
    target, drafter = setup(1)
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    proposer = DFlash2Proposer(drafter, embedding, head)
    prompt = torch.randint(0, 127, (9,), generator=torch.Generator().manual_seed(1))
    result = speculative_generate(target, prompt, proposer, 4, 20, temperature=0.8, generator=torch.Generator())
    assert len(result.tokens) == 20
    hidden = {i: torch.randn(3, 32, dtype=torch.float64) for i in drafter.config.target_layers}
    proposer.reset()
    tokens = torch.tensor([3, 8, 1, 44])
    tree = proposer.propose(ProposalContext(tokens, 4, 0.8, torch.Generator().manual_seed(3), 128, hidden))
    base = proposer.slot_hidden @ head.t()
    sel = drafter.candidate_selector
    prev = int(tokens[-1])
    for k in range(4):  # each distribution is the softmax of slot k's candidates' scores after the draft before
        candidates = base[k].topk(drafter.config.selector_top_k).indices
        bilinear = sel.predecessor_codebook[prev] * (sel.hidden_projection.weight @ proposer.slot_hidden[k])
        expected = torch.zeros(128, dtype=torch.float64)
        scores = base[k][candidates] + sel.successor_codebook[candidates] @ bilinear
        expected[candidates] = torch.softmax(scores / 0.8, 0)
        torch.testing.assert_close(tree.probs[k].double(), expected, rtol=1e-5, atol=1e-7)
        prev = int(tree.tokens[k])


def test_the_dflash2_export_reloads_with_identical_logits(tmp_path):
    target, drafter = setup(2)
    drafter = drafter.float()
    record = dflash2_kind.make_record(drafter.config, "some/target", ["LlamaForCausalLM"])
    assert record.kind == "dflash2"
    folder = dflash2_kind.DFLASH2.write(drafter, record, tmp_path / "dflash2")
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["architectures"] == ["DFlash2DraftModel"]
    assert config["sample_from_anchor"] is False and config["draft_vocab_size"] == 128
    for key in DFLASH2_KEYS:
        assert config[key] == getattr(drafter.config, key)
    assert dflash2_kind.DFLASH2.recognise(folder) and not dflash_kind.SPECULATORS.recognise(folder)
    again, again_record = dflash2_kind.DFLASH2.load(folder)
    assert again_record.target == "some/target" and again.config == drafter.config
    assert again_record.kind == "dflash2" and isinstance(again, DFlash2Drafter)
    embedding, head = target.get_input_embeddings().weight.float(), target.get_output_embeddings().weight.float()
    x = F.embedding(torch.tensor([[7, 127, 127, 127, 127]]), embedding)
    past = drafter.context_kv(torch.randn(1, 6, 32), torch.arange(6)[None])
    prev = torch.tensor([7, 3, 9, 11])
    with torch.no_grad():
        outs = [d.draft(x, torch.arange(6, 11)[None], past)[0, 1:] for d in (drafter, again)]
        rows = [d.candidate_selector.rescored(o @ head.t(), o, prev) for d, o in zip((drafter, again), outs)]
    assert torch.equal(rows[0], rows[1]) and torch.isfinite(rows[0]).sum() == 4 * drafter.config.selector_top_k
    # a file that leaves DFlash2's fields out is read with speculators' defaults
    for key in DFLASH2_KEYS:
        del config[key]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match="shape"):  # selector_rank 256, group 16: other shapes than the file's
        dflash2_kind.DFLASH2.load(folder)
    # the DFlash formats have no fields for DFlash2's weights: DFlash's writers refuse them
    with pytest.raises(UsageError, match=r"kind 'dflash2' cannot be written as 'dflash'; it writes: dflash2 \("):
        get_kind(record.kind, "test").format("dflash")
    for fmt in (dflash_kind.ZLAB, dflash_kind.SPECULATORS):
        with pytest.raises(ModelFolderError, match="no field for the heads of a DFlash2Drafter"):
            fmt.write(drafter, record, tmp_path / fmt.name)


def test_bad_input_is_refused_naming_the_value(tmp_path):
    save_target(tmp_path / "target")  # hidden size 16, vocabulary 64
    path = str(tmp_path / "target")
    options = dict(num_draft_layers=1, block_size=4, mask_token_id=V - 1, selector_rank=4, selector_top_k=4)
    with pytest.raises(RecipeError, match=r"model.conv_group_size=5 must divide the drafter's hidden_size 16"):
        DFlash2(path, conv_group_size=5, **options)
    with pytest.raises(RecipeError, match=r"model.conv_kernel_size=5 cannot exceed block_size=4"):
        DFlash2(path, conv_kernel_size=5, conv_group_size=4, **options)
    with pytest.raises(RecipeError, match=r"model.selector_top_k=65 cannot exceed the vocabulary's 64 tokens"):
        DFlash2(path, conv_group_size=4, **{**options, "selector_top_k": 65})
    with pytest.raises(RecipeError, match=r"model.selector_rank=0 must be an integer >= 1"):
        DFlash2(path, conv_group_size=4, **{**options, "selector_rank": 0})
    with pytest.raises(RecipeError, match=r"model.selector_loss_alpha=-1.0 must be >= 0"):
        DFlash2(path, conv_group_size=4, selector_loss_alpha=-1.0, **options)


def test_init_from_a_plain_dflash_keeps_the_backbone_and_starts_identity_convolutions(tmp_path):
    save_target(tmp_path / "target")
    path = str(tmp_path / "target")
    plain = DFlash(path, num_draft_layers=1, target_layers=[1, 3], block_size=4, mask_token_id=V - 1)
    record = dflash_kind.make_record(plain.drafter.config, path, ["LlamaForCausalLM"])
    folder = dflash_kind.SPECULATORS.write(plain.drafter, record, tmp_path / "plain")
    grown = DFlash2(path, init_from=str(folder), block_size=4, **SMALL)
    assert grown.drafter_record().kind == "dflash2" and grown.drafter.config.selector_rank == 5
    state = grown.drafter.state_dict()
    for name, tensor in plain.drafter.state_dict().items():
        assert torch.equal(state[name], tensor), name
    conv = grown.drafter.layers[0].attention_conv
    assert torch.equal(conv.base_kernel[:, 0], torch.ones_like(conv.base_kernel[:, 0]))
    assert not conv.kernel_projection.weight.any() and not conv.base_kernel[:, 1:].any()
    folder2 = dflash2_kind.DFLASH2.write(grown.drafter, grown.drafter_record(), tmp_path / "dflash2")
    back = DFlash(path, init_from=str(folder2), block_size=4)  # DFlash from DFlash2: the backbone, convolutions dropped
    assert type(back.drafter) is DFlashDrafter
    assert all(torch.equal(back.drafter.state_dict()[k], v) for k, v in plain.drafter.state_dict().items())


def test_the_recipe_and_the_compare_row():
    recipe = ROOT / "recipes" / "quickstart" / "dflash2.yaml"
    assert recipe.read_text().startswith("# draftsmith fit --config recipes/quickstart/dflash2.yaml\n")
    model = yaml.safe_load(recipe.read_text())["model"]
    assert model["class_path"] == "trainer.methods.dflash2.objective.DFlash2"
    assert model["init_args"]["selector_rank"] == 64
    parse_recipe([str(recipe)], [])  # every key a parameter of DFlash2
    compare = yaml.safe_load((ROOT / "recipes" / "compare" / "tiny.yaml").read_text())
    rows = {row["name"]: row for row in compare["methods"]}
    assert rows["dflash2"]["export_format"] == "dflash2" and rows["dflash2"]["k"] == [4, 15]
    assert get_kind("dflash2", "test").format("dflash2").name == "dflash2"
