"""XPress, DFlash's block refiner (trainer/methods/xpress/): the loss against a naive reference (each block drafted
alone, the refiner's bias written out slot by slot, the teacher-forced, free-running and backbone terms), K Jacobi
passes against the left-to-right resolution, greedy drafting identical to the target alone (chain and tree), sampled
drafts returning the distributions given the drafts before them, the ``xpress`` export reloaded with identical
logits, bad values refused naming the key, and the quickstart recipe and compare row."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import tiny_llama
from tests.unit.test_dflash_objective import V, save_target
from trainer.decoding.generate import speculative_generate
from trainer.decoding.proposers import NoProposer, ProposalContext
from trainer.interface.errors import ModelFolderError, RecipeError, UsageError
from trainer.methods.dflash import kind as dflash_kind
from trainer.methods.dflash.module import DFlashConfig
from trainer.methods.dflash.objective import DFlash
from trainer.methods.dflash.refiner import LogitBias, SlotTerm
from trainer.methods.xpress import kind as xpress_kind
from trainer.methods.xpress import objective as xpress_objective
from trainer.methods.xpress.module import REFINER_KEYS, XPressConfig, XPressDrafter
from trainer.methods.xpress.objective import XPress
from trainer.methods.xpress.proposer import XPressProposer, XPressTreeProposer
from trainer.training.recipe import parse_recipe
from trainer.training.registry import get_kind

ROOT = Path(__file__).resolve().parents[2]


def naive_bias(drafter: XPressDrafter, slots: torch.Tensor, prev: list[int]) -> torch.Tensor:
    """The refiner's bias [b, V] of one block's outputs ``slots`` [b, H] and previous tokens, slot by slot."""
    h = drafter.refiner_head
    b = slots.shape[0]
    g = slots.mean(0)
    a = [h.in_proj.weight @ torch.cat([h.down_h.weight @ slots[k], h.down_g.weight @ g, h.token_embed.weight[prev[k]]])
         for k in range(b)]  # fmt: skip
    out = []
    for k in range(b):
        c = a[k] + sum(h.mix_l[:, k, j] * a[j] for j in range(k + 1))
        x = c + h.mlp_down.weight @ (F.silu(h.mlp_gate.weight @ c) * (h.mlp_up.weight @ c))
        out.append(h.readout.weight @ x)
    return torch.stack(out)


def naive_xpress_loss(objective: XPress, ids: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each term's loss (data labels' cross entropy, slots weighted exp(-(k - 1) / gamma) normalised by the weights;
    the base anchor's a plain mean with ``base_anchor_full_weight``) and the total, differentiable in the drafter."""
    drafter, target = objective.drafter, objective.target
    c = drafter.config
    b, (B, S) = c.block_size, ids.shape
    trained = F.pad(loss_mask[:, :-1], (1, 0), value=False)
    anchors, keep = objective.anchors(trained, "train")
    out = target.model(ids, output_hidden_states=True)
    head, embedding = target.lm_head_weight, objective.embedding_weight()
    passes, full = objective.consistency_passes, objective.base_anchor_full_weight
    names = ["tf", *(f"consistency_round{j}" for j in range(passes)), "base_anchor"]
    sums = dict.fromkeys(names, 0.0)
    weights = 0.0
    n = 0
    for r in range(B):
        context = drafter.context([out.hidden_states[i][r : r + 1] for i in c.target_layers])
        for j in range(anchors.shape[1]):
            if not keep[r, j]:
                continue
            a = int(anchors[r, j])
            past = drafter.context_kv(context[:, :a], torch.arange(a)[None])
            block = torch.tensor([[int(ids[r, a])] + [c.mask_token_id] * (b - 1)])
            slots = drafter.draft(F.embedding(block, embedding), torch.arange(a, a + b)[None], past)[0]  # [b, H]
            base = slots @ head.t()  # [b, V]
            teacher = [int(ids[r, a - 1]) if a > 0 else int(ids[r, a])]
            teacher += [int(ids[r, min(a + k - 1, S - 1)]) for k in range(1, b)]
            logits = {"tf": base + naive_bias(drafter, slots, teacher), "base_anchor": base}
            guess = base.argmax(-1).tolist()
            for p in range(passes):
                guess[0] = int(ids[r, a])
                refined = base + naive_bias(drafter, slots, [teacher[0]] + guess[:-1])
                logits[f"consistency_round{p}"] = refined
                guess = refined.argmax(-1).tolist()
            for k in range(1, b):
                t = a + k
                if t >= S or not trained[r, t]:
                    continue
                w = math.exp(-(k - 1) / objective.gamma)
                for name in names:
                    loss = F.cross_entropy(logits[name][k][None], ids[r, t][None])
                    sums[name] = sums[name] + (loss if name == "base_anchor" and full else w * loss)
                weights += w
                n += 1
    terms = {name: sums[name] / (n if name == "base_anchor" and full else weights) for name in names}
    rounds = sum(terms[f"consistency_round{p}"] for p in range(passes)) / passes
    terms["total"] = (
        terms["tf"] + objective.consistency_weight * rounds + objective.base_anchor_weight * terms["base_anchor"]
    )
    return terms


def make_objective(tmp_path: Path, cls: type[XPress] = XPress, **options) -> XPress:
    save_target(tmp_path / "target")
    settings = dict(
        num_draft_layers=1, target_layers=[1, 3], block_size=4, mask_token_id=V - 1, max_anchors=3, labels="data",
        loss_chunk_size=5, xpress_rank=6, consistency_passes=2, base_anchor_full_weight=True,
    )  # fmt: skip
    objective = cls(str(tmp_path / "target"), **{**settings, **options})
    torch.manual_seed(3)
    for p in objective.drafter.parameters():
        nn.init.normal_(p, std=0.3)  # mix_l starts at zero: random, so that the mixer counts
    return objective


@pytest.mark.parametrize("full", [True, False])
def test_the_loss_equals_blocks_drafted_alone_with_the_refiner_written_out(full, tmp_path):
    objective = make_objective(tmp_path, base_anchor_full_weight=full)
    ids = torch.randint(0, V - 1, (2, 11), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.ones(2, 11, dtype=torch.bool)
    loss_mask[0, :4] = False
    with torch.no_grad():
        loss, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
        expected = naive_xpress_loss(objective, ids, loss_mask)
    torch.testing.assert_close(float(loss), float(expected["total"]), rtol=1e-5, atol=0)
    for name in ("tf", "consistency_round0", "consistency_round1", "base_anchor"):
        torch.testing.assert_close(float(metrics[f"loss_{name}"]), float(expected[name]), rtol=1e-5, atol=0)
    assert float(expected["consistency_round1"]) != pytest.approx(float(expected["tf"]), rel=1e-3)  # not void
    loss, _ = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
    loss.backward()  # every refiner weight trains
    for name, p in objective.drafter.refiner_head.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # no free-running rounds and no anchor: the teacher-forced term alone
    objective = make_objective(tmp_path, consistency_weight=0.0, base_anchor_weight=0.0)
    with torch.no_grad():
        loss, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
        expected = naive_xpress_loss(objective, ids, loss_mask)
    torch.testing.assert_close(float(loss), float(expected["tf"]), rtol=1e-5, atol=0)
    assert set(k for k in metrics if k.startswith("loss_")) == {"loss_tf"}


def gradients(objective: XPress, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradients of ``loss`` with respect to every drafter weight (0 where it does not reach one)."""
    objective.drafter.zero_grad(set_to_none=True)
    loss.backward()
    return {
        name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for name, p in objective.drafter.named_parameters()
    }


@pytest.mark.parametrize("full", [True, False])
def test_the_shared_pass_has_the_naive_formulas_gradients(full, tmp_path):
    objective = make_objective(tmp_path, base_anchor_full_weight=full, consistency_passes=3)
    ids = torch.randint(0, V - 1, (2, 11), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.ones(2, 11, dtype=torch.bool)
    loss_mask[0, :4] = False
    loss_mask[1, 6] = False  # an untrained slot inside a block: its argmax still seeds the slots after it
    loss, _ = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
    ours = gradients(objective, loss)
    expected = naive_xpress_loss(objective, ids, loss_mask)
    torch.testing.assert_close(loss.detach(), expected["total"].detach(), rtol=1e-5, atol=0)
    reference = gradients(objective, expected["total"])
    for name, grad in reference.items():
        assert grad.abs().sum() > 0, name  # every weight trains (the backbone's and the refiner's)
        torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-6, msg=name)


class PerTerm(XPress):
    """XPress's loss as each term's own slot loss (DFlash's), every free-running round's argmax its own projection of
    the slots onto the vocabulary: the computation the shared pass replaces."""

    def slot_terms(self, blocks, anchors, ids, idx, prev):
        refiner = self.drafter.refiner_head
        B, N, b, _ = blocks.shape
        positions = anchors[:, :, None] + torch.arange(-1, b - 1)
        positions[:, :, 0] = torch.where(anchors > 0, anchors - 1, anchors)
        teacher = ids.gather(1, positions.clamp(max=ids.shape[1] - 1).flatten(1)).view(B, N, b)
        cache = refiner.hidden_cache(blocks)
        head = self.target.lm_head_weight.detach()

        def trained(features):
            return LogitBias(features[:, :, 1:].flatten(0, 2)[idx], refiner.readout.weight)

        def argmax(features=None):
            with torch.no_grad():
                logits = blocks.detach() @ head.t()
                return (logits if features is None else logits + refiner.bias(features.detach())).argmax(-1)

        terms = [SlotTerm(trained(refiner.features(teacher, cache)), name="tf")]
        guess = argmax()
        for j in range(self.consistency_passes):
            guess[:, :, 0] = ids.gather(1, anchors)
            features = refiner.features(torch.cat([teacher[:, :, :1], guess[:, :, :-1]], dim=-1), cache)
            scale = self.consistency_weight / self.consistency_passes
            terms.append(SlotTerm(trained(features), scale=scale, name=f"consistency_round{j}"))
            if j + 1 < self.consistency_passes:
                guess = argmax(features)
        terms.append(
            SlotTerm(None, scale=self.base_anchor_weight, name="base_anchor", uniform=self.base_anchor_full_weight)
        )
        return terms


OPTIONS = [
    dict(labels="argmax"),
    dict(labels="soft", loss="tv"),
    dict(labels="argmax", position_weights="dpace", base_anchor_full_weight=False),
    dict(labels="data", loss="lk_hybrid", loss_chunk_size=3),
    dict(labels="argmax", loss_chunk_size=64, max_anchors=6),
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_the_shared_pass_equals_every_term_on_its_own(options, tmp_path):
    """Labels, losses, D-PACE weights and chunkings: the same losses, metrics and gradients as each term's own slot
    loss."""
    settings = dict(consistency_passes=3, **options)
    ours, theirs = make_objective(tmp_path, **settings), make_objective(tmp_path, cls=PerTerm, **settings)
    ids = torch.randint(0, V - 1, (3, 14), generator=torch.Generator().manual_seed(2))
    loss_mask = torch.ones(3, 14, dtype=torch.bool)
    loss_mask[0, :3] = False
    loss_mask[2, 8] = False
    batch = {"input_ids": ids, "loss_mask": loss_mask}
    loss, metrics = ours.compute_loss(batch)
    expected, expected_metrics = theirs.compute_loss(batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    assert metrics.keys() == expected_metrics.keys()
    for name, value in expected_metrics.items():
        torch.testing.assert_close(metrics[name], value, rtol=1e-5, atol=1e-7, msg=name)
    grads, reference = gradients(ours, loss), gradients(theirs, expected)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


class HeadProducts(TorchDispatchMode):
    """Counts the matrix products that read the target's lm_head weight [V, H] (the slots' and the target's
    projections onto the vocabulary, and the gradients taken back through it)."""

    def __init__(self, head: torch.Tensor) -> None:
        super().__init__()
        self.storage, self.count = head.untyped_storage().data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.matmul):
            if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.storage for a in args):
                self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_step_projects_the_slots_onto_the_vocabulary_once(tmp_path):
    """Argmax labels, three rounds and the backbone's term, one chunk: the slots' logits once and their summed
    gradient once, the target's argmax and distribution once each (each term on its own: thirteen products of the
    slots and ten of the target's)."""
    ids = torch.randint(0, V - 1, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "loss_mask": torch.ones(2, 16, dtype=torch.bool)}
    counts = {}
    for cls in (XPress, PerTerm):
        objective = make_objective(tmp_path, cls=cls, labels="argmax", consistency_passes=3, loss_chunk_size=4096)
        with HeadProducts(objective.target.lm_head_weight) as products:
            loss, _ = objective.compute_loss(batch)
            loss.backward()
        counts[cls] = products.count
    assert counts == {XPress: 2 + 2, PerTerm: 13 + 10}


@pytest.mark.parametrize("cls", [DFlash, XPress])
def test_the_target_distribution_is_taken_only_on_steps_whose_metrics_are_logged(cls, tmp_path, monkeypatch):
    """Argmax labels: the target's distribution is read by the ``alpha_k`` metrics alone, so on a step whose metrics
    Lightning does not write (``metrics_due`` False) it is not taken (one product with the target's head fewer), no
    alpha is logged, and the loss, every other metric and the gradients are the logged step's (XPress's, on a chunk
    with untrained slots, then scores its first term on every slot too)."""
    ids = torch.randint(0, V - 1, (2, 16), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.ones(2, 16, dtype=torch.bool)
    loss_mask[1, 12:] = False  # a chunk with untrained slots
    batch = {"input_ids": ids, "loss_mask": loss_mask}
    runs = {}
    for due in (True, False):
        options = dict(labels="argmax", loss_chunk_size=4096)  # one chunk
        if cls is XPress:
            objective = make_objective(tmp_path, consistency_passes=3, **options)
        else:
            save_target(tmp_path / "target")
            objective = DFlash(str(tmp_path / "target"), num_draft_layers=1, target_layers=[1, 3], block_size=4,
                               mask_token_id=V - 1, max_anchors=3, **options)  # fmt: skip
            torch.manual_seed(3)
            for p in objective.drafter.parameters():
                nn.init.normal_(p, std=0.3)
        monkeypatch.setattr(objective, "metrics_due", lambda due=due: due)
        torch.manual_seed(0)  # the same anchors
        with HeadProducts(objective.target.lm_head_weight) as products:
            loss, metrics = objective.compute_loss(batch)
        runs[due] = (loss, metrics, gradients(objective, loss), products.count)
    (loss, metrics, grads, count), (quiet, quiet_metrics, quiet_grads, quiet_count) = runs[True], runs[False]
    assert any(k.startswith("alpha_") for k in metrics) and not any(k.startswith("alpha_") for k in quiet_metrics)
    assert {k for k in metrics if not k.startswith("alpha_")} == set(quiet_metrics)
    torch.testing.assert_close(quiet, loss, rtol=0, atol=0)
    for name, value in quiet_metrics.items():
        torch.testing.assert_close(value, metrics[name], rtol=0, atol=0, msg=name)
    for name, grad in grads.items():  # to rounding: the terms' gradients are summed in another order
        torch.testing.assert_close(quiet_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert quiet_count == count - 1  # the target's logits of the chunk


def setup(seed: int = 0, **refiner) -> tuple[nn.Module, XPressDrafter]:
    target = tiny_llama(seed, vocab=128, layers=4)  # float64, eval
    config = DFlashConfig.from_target(target.config, 2, (1, 3), block_size=6, mask_token_id=127)
    config = XPressConfig(**{**config.to_dict(), "xpress_rank": 8, **refiner})
    torch.manual_seed(seed)
    drafter = XPressDrafter(config)
    for p in drafter.parameters():
        nn.init.normal_(p, std=0.3)
    return target, drafter.to(torch.float64).eval()


def round_context(drafter: XPressDrafter, tokens: torch.Tensor, k: int, temperature: float = 0.0, seed: int = 0):
    hidden = {i: torch.randn(tokens.numel() - 1, 32, dtype=torch.float64) for i in drafter.config.target_layers}
    return ProposalContext(tokens, k, temperature, torch.Generator().manual_seed(seed), 128, hidden)


def test_jacobi_passes_reach_the_left_to_right_resolution(one_thread):
    target, drafter = setup()
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    proposer = XPressProposer(drafter, embedding, head)
    tokens = torch.tensor([5, 9, 17, 4, 60, 33, 2])
    torch.manual_seed(0)
    proposer.block_logits(round_context(drafter, tokens, 5))
    logits = proposer.slot_hidden @ head.t()  # [b - 1, V]
    # left to right, written out: slot k's argmax given the drafts before it (naive_bias of the whole block)
    prev, expected = [int(tokens[-2]), int(tokens[-1])], []
    for k in range(5):
        bias = naive_bias(drafter, proposer.block_hidden, prev + [127] * (6 - len(prev)))
        expected.append(int((logits[k] + bias[k + 1]).argmax()))
        prev.append(expected[-1])
    ctx = round_context(drafter, tokens, 5)
    assert proposer.sequential(ctx, logits)[0].tolist() == expected
    assert proposer.jacobi(tokens, logits, 0)[0].tolist() == logits.argmax(-1).tolist()
    assert logits.argmax(-1).tolist() != expected  # the refiner changes the drafts (else the checks are void)
    for passes in range(6):
        drafts = proposer.jacobi(tokens, logits, passes)[0].tolist()
        assert drafts[:passes] == expected[:passes]  # after pass j the first j drafts are resolved
    assert proposer.jacobi(tokens, logits, 5)[0].tolist() == expected  # K >= b - 1: the fixed point
    assert proposer.jacobi(tokens, logits, 50)[0].tolist() == expected


@pytest.mark.parametrize("passes", [1, 6])
def test_greedy_chains_and_trees_are_identical_to_the_target_alone(passes, one_thread):
    target, drafter = setup(1, num_jacobi_passes=passes)
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    prompt = torch.randint(0, 127, (11,), generator=torch.Generator().manual_seed(0))
    alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=30).tokens
    chain = XPressProposer(drafter, embedding, head)
    for proposer in (chain, XPressTreeProposer(drafter, embedding, head, top_k=3, budget=10)):
        assert speculative_generate(target, prompt, proposer, k=5, max_new_tokens=30).tokens == alone
    assert chain.passes == passes and chain.passes_run > 0


def test_sampled_chains_return_the_distributions_given_the_drafts_before(one_thread):
    target, drafter = setup(2)
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    proposer = XPressProposer(drafter, embedding, head)
    prompt = torch.randint(0, 127, (9,), generator=torch.Generator().manual_seed(1))
    result = speculative_generate(target, prompt, proposer, 4, 20, temperature=0.8, generator=torch.Generator())
    assert len(result.tokens) == 20
    proposer.reset()
    tokens = torch.tensor([3, 8, 1, 44])
    tree = proposer.propose(round_context(drafter, tokens, 4, 0.8, 3))
    base = proposer.slot_hidden @ head.t()
    prev = [int(tokens[-2]), int(tokens[-1])]
    for k in range(4):  # each distribution is slot k's refined softmax after the drafts before it
        bias = naive_bias(drafter, proposer.block_hidden, prev + [127] * (6 - len(prev)))
        expected = torch.softmax((base[k] + bias[k + 1]) / 0.8, dim=-1)
        torch.testing.assert_close(tree.probs[k].double(), expected, rtol=1e-5, atol=1e-7)
        prev.append(int(tree.tokens[k]))


def test_the_xpress_export_reloads_with_identical_logits(tmp_path):
    target, drafter = setup(3, xpress_mlp_ratio=3, num_jacobi_passes=4)
    drafter = drafter.float()
    record = xpress_kind.make_record(drafter.config, "some/target", ["LlamaForCausalLM"])
    assert record.kind == "xpress"
    folder = xpress_kind.XPRESS.write(drafter, record, tmp_path / "xpress")
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "xpress" and config["architectures"] == ["XPressSpeculator"]
    assert config["sample_from_anchor"] is False
    assert {key: config[key] for key in REFINER_KEYS} == {
        "xpress_rank": 8,
        "xpress_mlp_ratio": 3,
        "num_jacobi_passes": 4,
    }
    assert xpress_kind.XPRESS.recognise(folder) and not dflash_kind.SPECULATORS.recognise(folder)
    again, again_record = xpress_kind.XPRESS.load(folder)
    assert again_record.target == "some/target" and again.config == drafter.config
    assert again_record.kind == "xpress" and isinstance(again, XPressDrafter)
    embedding = target.get_input_embeddings().weight.float()
    x = F.embedding(torch.tensor([[7, 127, 127, 127, 127, 127]]), embedding)
    past = drafter.context_kv(torch.randn(1, 6, 32), torch.arange(6)[None])
    prev = torch.tensor([[7, 3, 9, 11, 2, 5]])
    with torch.no_grad():
        outs = []
        for d in (drafter, again):
            h = d.draft(x, torch.arange(6, 12)[None], past)
            outs.append(
                h @ embedding.t() + d.refiner_head.bias(d.refiner_head.features(prev, d.refiner_head.hidden_cache(h)))
            )
    assert torch.equal(outs[0], outs[1])
    # a file without the refiner's fields reads speculators' defaults; sample_from_anchor true is refused
    del config["xpress_mlp_ratio"], config["num_jacobi_passes"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match="mlp_down.weight has shape"):  # the default ratio 2 does not fit
        xpress_kind.XPRESS.load(folder)
    config["sample_from_anchor"] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match="sample_from_anchor true"):
        xpress_kind.XPRESS.load(folder)
    with pytest.raises(UsageError, match=r"kind 'xpress' cannot be written as 'dflash'; it writes: xpress \("):
        get_kind(record.kind, "test").format("dflash")
    for fmt in (dflash_kind.ZLAB, dflash_kind.SPECULATORS):
        with pytest.raises(ModelFolderError, match="no field for the heads of a XPressDrafter"):
            fmt.write(drafter, record, tmp_path / fmt.name)


def test_bad_values_are_refused_naming_the_key(tmp_path):
    save_target(tmp_path / "target")
    path = str(tmp_path / "target")
    options = dict(num_draft_layers=1, block_size=4, mask_token_id=V - 1)
    bad = (("xpress_rank", 0), ("xpress_mlp_ratio", 1.5), ("num_jacobi_passes", -1), ("consistency_passes", -2),
           ("consistency_weight", -0.1), ("base_anchor_weight", -1.0))  # fmt: skip
    for key, value in bad:
        with pytest.raises(RecipeError, match=rf"model\.{key}="):
            XPress(path, **options, **{key: value})


def test_the_quickstart_recipe_and_the_compare_row():
    recipe = ROOT / "recipes" / "quickstart" / "xpress.yaml"
    assert recipe.read_text().splitlines()[0] == "# draftsmith fit --config recipes/quickstart/xpress.yaml"
    parsed = parse_recipe([str(recipe)])
    assert parsed.model.class_path == "trainer.methods.xpress.objective.XPress"
    args = parsed.model.init_args
    assert (args.xpress_rank, args.xpress_mlp_ratio, args.num_jacobi_passes) == (64, 2, 6)
    assert (args.consistency_weight, args.consistency_passes, args.base_anchor_weight) == (0.3, 3, 0.6)
    dflash = parse_recipe([str(ROOT / "recipes" / "quickstart" / "dflash.yaml")]).model.init_args
    keys = ("target", "num_draft_layers", "block_size", "mask_token_id", "max_anchors", "position_weights", "labels")
    for key in keys:
        assert args[key] == dflash[key], key  # the DFlash drafter of dflash.yaml (D-PACE), the refiner aside
    rows = {
        row["name"]: row for row in yaml.safe_load((ROOT / "recipes" / "compare" / "tiny.yaml").read_text())["methods"]
    }
    assert rows["xpress"] == {
        "name": "xpress",
        "recipe": "recipes/quickstart/xpress.yaml",
        "export_format": "xpress",
        "k": [4, 15],
    }


def test_drafting_passes_draft_from_the_logits_the_training_rounds_score(tmp_path, monkeypatch, one_thread):
    """The same tokens through the training step (two blocks of a row, every slot trained) and the proposer (a round
    at each anchor): greedy Jacobi pass p's refined logits are those free-running round p - 1 scores."""
    objective = make_objective(tmp_path, block_size=6, consistency_passes=3, loss_chunk_size=4096)
    b, anchors = 6, [3, 8]
    ids = torch.randint(0, V - 1, (1, 16), generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(objective, "anchors", lambda trained, stage: (torch.tensor([anchors]), torch.ones(1, 2).bool()))
    scored, slot_rows, later = [], xpress_objective.slot_rows, xpress_objective.cross_entropy_rows

    def record(rows):
        def score(logits, labels, need_grad):
            scored.append(logits.clone())  # [n, V]: the slots of both blocks, block by block
            return rows(logits, labels, need_grad)

        return score

    monkeypatch.setattr(xpress_objective, "cross_entropy_rows", record(later))  # the terms after the first
    monkeypatch.setattr(xpress_objective, "slot_rows", lambda spec: record(slot_rows(spec)))
    with torch.no_grad():
        objective.compute_loss({"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)})
        states = objective.target.model(ids, output_hidden_states=True).hidden_states
    assert len(scored) == 5  # one chunk: the teacher-forced term, three rounds, the backbone's own
    proposer = XPressProposer(objective.drafter, objective.embedding_weight(), objective.target.lm_head_weight)
    changed = False
    for i, a in enumerate(anchors):
        hidden = {layer: states[layer][0, :a] for layer in objective.drafter.config.target_layers}
        tokens = ids[0, : a + 1]
        proposer.reset()
        with torch.no_grad():
            logits = proposer.block_logits(ProposalContext(tokens, b - 1, 0.0, None, V, hidden))  # [b - 1, V]
            torch.testing.assert_close(logits, scored[-1][i * (b - 1) : (i + 1) * (b - 1)], rtol=1e-5, atol=1e-5)
            for passes in (1, 2, 3):
                drafts, rows = proposer.jacobi(tokens, logits, passes)
                trained = scored[passes][i * (b - 1) : (i + 1) * (b - 1)]  # round passes - 1
                torch.testing.assert_close(rows, trained, rtol=1e-5, atol=1e-5)
                assert drafts.tolist() == trained.argmax(-1).tolist()
                changed |= drafts.tolist() != logits.argmax(-1).tolist()
    assert changed  # the refiner moves some draft: the rounds are not the backbone's argmax


def test_slot_zero_reads_the_anchor_at_a_documents_start(tmp_path, monkeypatch):
    """Packed rows: the block anchored at a document's first token conditions slot 0 on the anchor, as at a row's
    start (and as drafting does at a sequence's start), not on the previous document's last token."""
    objective = make_objective(tmp_path)
    ids = torch.randint(0, V - 1, (1, 12), generator=torch.Generator().manual_seed(5))
    documents = torch.tensor([[0] * 5 + [1] * 7])
    monkeypatch.setattr(objective, "anchors", lambda trained, stage: (torch.tensor([[5, 7]]), torch.ones(1, 2).bool()))
    seen = []
    real = XPress.slot_terms

    def slot_terms(self, *args):
        terms = real(self, *args)
        seen.append(terms[0].bias.step.teacher[0, :, 0].tolist())
        return terms

    monkeypatch.setattr(XPress, "slot_terms", slot_terms)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    with torch.no_grad():
        objective.compute_loss(batch)
        objective.compute_loss({**batch, "document_ids": documents})
    assert seen == [[int(ids[0, 4]), int(ids[0, 6])], [int(ids[0, 5]), int(ids[0, 6])]]
