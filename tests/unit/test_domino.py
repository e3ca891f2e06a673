"""Domino, DFlash's block refiner (trainer/methods/domino/): the loss against a naive float64 reference (each block
drafted alone, a hand-written GRU over the data's block tokens, the low-rank delta on the slots past
pure_draft_prefix_len, the base-anchor mix of the corrected and the backbone's losses), the lambda schedule, chains
lossless and resolved left to right through the head, the ``domino`` export (SpecForge's layout) reloaded with
identical logits, and bad input refused naming the value."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from tests.helpers import tiny_llama
from tests.unit.test_dflash_objective import V, save_target
from trainer.decoding.generate import speculative_generate
from trainer.decoding.options import ProposerOptions
from trainer.decoding.proposers import NoProposer, ProposalContext
from trainer.interface.errors import ModelFolderError, RecipeError, UsageError
from trainer.methods.dflash import kind as dflash_kind
from trainer.methods.dflash.module import DFlashConfig
from trainer.methods.dflash.objective import DFlash
from trainer.methods.domino import kind as domino_kind
from trainer.methods.domino.module import HEAD_KEYS, DominoConfig, DominoDrafter
from trainer.methods.domino.objective import Domino, base_weight
from trainer.methods.domino.proposer import DominoProposer

HEAD = dict(emb_dim=5, gru_hidden_dim=6)


def gru_states(drafter: DominoDrafter, x: torch.Tensor) -> torch.Tensor:
    """The GRU's states [T, G] after each of the inputs x [T, H], by its equations (no biases; torch's gate order
    r, z, n)."""
    w_ih, w_hh = drafter.prefix_gru.weight_ih_l0, drafter.prefix_gru.weight_hh_l0
    (w_ir, w_iz, w_in), (w_hr, w_hz, w_hn) = w_ih.chunk(3), w_hh.chunk(3)
    h = x.new_zeros(w_hh.shape[1])
    out = []
    for t in range(x.shape[0]):
        r = torch.sigmoid(w_ir @ x[t] + w_hr @ h)
        z = torch.sigmoid(w_iz @ x[t] + w_hz @ h)
        n = torch.tanh(w_in @ x[t] + r * (w_hn @ h))
        h = (1 - z) * n + z * h
        out.append(h)
    return torch.stack(out)


def delta(drafter: DominoDrafter, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The head's logit delta [V] of a slot's output [H] and the GRU's state [G], written out."""
    w0, w2 = drafter.embed_proj[0].weight, drafter.embed_proj[2].weight
    return w2 @ F.silu(w0 @ torch.cat([hidden, state]))


def slot_loss_of(logits: torch.Tensor, label: torch.Tensor, loss: str) -> float:
    """One slot's loss toward a token label: the cross entropy (kl), or 1 - q_label (tv)."""
    if loss == "tv":
        return float(1 - torch.softmax(logits, -1)[label])
    return float(F.cross_entropy(logits[None], label[None]))


def naive_domino_loss(
    objective: Domino, ids: torch.Tensor, loss_mask: torch.Tensor, lam: float, loss: str = "kl"
) -> tuple[float, ...]:
    """(loss, final, base) in float64 (the objective runs in float32): each block drafted alone, slot k's logits the
    lm_head's plus, past pure_draft_prefix_len, the delta from the GRU's state after the data's tokens a..a+k-1; data
    labels weighted exp(-(k - 1) / gamma) and normalised by the weights; loss = (1 - lam) * final + lam * base."""
    drafter, target = copy.deepcopy(objective.drafter).double(), objective.target
    c = drafter.config
    b, (B, S) = c.block_size, ids.shape
    trained = F.pad(loss_mask[:, :-1], (1, 0), value=False)
    anchors, keep = objective.anchors(trained, "train")
    out = copy.deepcopy(target.model).double()(ids, output_hidden_states=True)
    head, embedding = target.lm_head_weight.double(), objective.embedding_weight().double()
    final = base = weights = 0.0
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
                logits = slots[k] @ head.t()  # [V]
                corrected = logits
                if k > c.pure_draft_prefix_len:
                    states = gru_states(drafter, embedding[ids[r, a:p]])  # the tokens before slot k's, in the block
                    corrected = logits + delta(drafter, slots[k], states[-1])
                w = math.exp(-(k - 1) / objective.gamma)
                final += w * slot_loss_of(corrected, ids[r, p], loss)
                base += w * slot_loss_of(logits, ids[r, p], loss)
                weights += w
    final, base = final / weights, base / weights
    return (1 - lam) * final + lam * base, final, base


def objective_of(tmp_path, **options) -> Domino:
    save_target(tmp_path / "target")
    objective = Domino(
        str(tmp_path / "target"), num_draft_layers=1, target_layers=[1, 3], block_size=5, mask_token_id=V - 1,
        max_anchors=3, labels="data", loss_chunk_size=4, **{**HEAD, **options},
    )  # fmt: skip
    torch.manual_seed(0)  # the weights below, whatever the drafter's own initialisation drew
    for p in objective.drafter.parameters():
        nn.init.normal_(p, std=0.3)
    return objective


@pytest.mark.parametrize("prefix, step, name", [(1, 3, "kl"), (0, 3, "kl"), (1, 9, "kl"), (1, 3, "tv")])
def test_the_loss_is_the_curriculum_mix_of_blocks_drafted_alone(prefix, step, name, tmp_path, monkeypatch):
    objective = objective_of(tmp_path, pure_draft_prefix_len=prefix, lambda_base_decay_ratio=0.6, loss=name)
    monkeypatch.setattr(objective, "schedule_position", lambda: (step, 10))  # lambda 0.5 at step 3, 0 at step 9
    lam = base_weight(step, 10, 1.0, 0.6)
    assert lam == (0.5 if step == 3 else 0.0)
    ids = torch.randint(0, V - 1, (2, 12), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.ones(2, 12, dtype=torch.bool)
    loss_mask[0, :4] = False
    with torch.no_grad():
        loss, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
        expected, final, base = naive_domino_loss(objective, ids, loss_mask, lam, name)
    assert abs(final - base) > 1e-4  # the head changes the loss (by far more than the tolerance below)
    torch.testing.assert_close(float(loss), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(float(metrics["loss_final"]), final, rtol=1e-5, atol=0)
    assert float(metrics["lambda_base"]) == lam
    if lam > 0:
        torch.testing.assert_close(float(metrics["loss_base"]), base, rtol=1e-5, atol=0)
    else:
        assert "loss_base" not in metrics  # the base term is skipped once lambda is 0
    loss, _ = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
    loss.backward()  # the head trains through the slot loss's bias
    head = (objective.drafter.prefix_gru.weight_ih_l0, objective.drafter.prefix_gru.weight_hh_l0,
            objective.drafter.embed_proj[0].weight, objective.drafter.embed_proj[2].weight)  # fmt: skip
    assert all(p.grad.abs().sum() > 0 for p in head)


def test_lambda_decays_linearly_to_zero_over_the_decay_ratio_of_the_run(tmp_path):
    assert [base_weight(s, 100, 1.0, 0.5) for s in (0, 10, 25, 49, 50, 80, 100)] == [
        1.0, 0.8, 0.5, pytest.approx(0.02), 0.0, 0.0, 0.0
    ]  # fmt: skip
    assert [base_weight(s, 10, 0.6, 1.0) for s in (0, 5, 10)] == [0.6, pytest.approx(0.3), 0.0]
    assert base_weight(0, 0, 1.0, 0.5) == 0.0  # no known length: the corrected loss alone, as SpecForge
    assert base_weight(0, 3, 1.0, 0.1) == 1.0 and base_weight(1, 3, 1.0, 0.1) == 0.0  # at least one decay step
    objective = objective_of(tmp_path, lambda_base_start=0.8, lambda_base_decay_ratio=0.5)
    assert objective.schedule_position() == (0, 0) and objective.lambda_base() == 0.0  # outside a run
    objective._trainer = SimpleNamespace(max_steps=20, global_step=5, estimated_stepping_batches=99)
    assert objective.schedule_position() == (5, 20) and objective.lambda_base() == pytest.approx(0.4)
    objective._trainer = SimpleNamespace(max_steps=-1, global_step=5, estimated_stepping_batches=40)
    assert objective.schedule_position() == (5, 40) and objective.lambda_base() == pytest.approx(0.6)
    objective._trainer = SimpleNamespace(max_steps=-1, global_step=5, estimated_stepping_batches=math.inf)
    assert objective.lambda_base() == 0.0
    objective._trainer = None


def setup(seed: int = 0, **head) -> tuple[nn.Module, DominoDrafter]:
    target = tiny_llama(seed, vocab=128, layers=4)  # float64, eval
    config = DFlashConfig.from_target(target.config, 2, (1, 3), block_size=5, mask_token_id=127)
    config = DominoConfig(**{**config.to_dict(), **HEAD, **head})
    torch.manual_seed(seed)
    drafter = DominoDrafter(config)
    for p in drafter.parameters():
        nn.init.normal_(p, std=0.3)
    return target, drafter.to(torch.float64).eval()


def by_hand(drafter: DominoDrafter, proposer: DominoProposer, head, embedding, root: int, k: int) -> list[list]:
    """The last block's drafts and corrected logits, slot after slot, the GRU written out over the root and drafts."""
    base = proposer.slot_hidden @ head.t()  # [b - 1, V]
    tokens, rows = [root], []
    for s in range(k):
        row = base[s]
        if s + 1 > drafter.config.pure_draft_prefix_len:
            state = gru_states(drafter, embedding[torch.tensor(tokens)])[-1]
            row = row + delta(drafter, proposer.slot_hidden[s], state)
        rows.append(row)
        tokens.append(int(row.argmax()))
    return [tokens[1:], rows]


@pytest.mark.parametrize("prefix", [1, 0])
def test_greedy_chains_are_lossless_and_resolve_the_head_left_to_right(prefix, one_thread):
    target, drafter = setup(0, pure_draft_prefix_len=prefix)
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    prompt = torch.randint(0, 127, (11,), generator=torch.Generator().manual_seed(0))
    alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=30).tokens
    proposer = DominoProposer(drafter, embedding, head)
    assert speculative_generate(target, prompt, proposer, k=4, max_new_tokens=30).tokens == alone
    hidden = {i: torch.randn(6, 32, dtype=torch.float64) for i in drafter.config.target_layers}
    proposer.reset()
    tokens = torch.tensor([5, 9, 17, 4, 60, 33, 2])
    drafts = proposer.propose(ProposalContext(tokens=tokens, k=4, vocab_size=128, hidden_states=hidden)).tokens
    expected, _ = by_hand(drafter, proposer, head, embedding, int(tokens[-1]), 4)
    assert drafts.tolist() == expected
    plain = (proposer.slot_hidden[:4] @ head.t()).argmax(-1).tolist()
    assert plain[prefix:] != expected[prefix:] and plain[:prefix] == expected[:prefix]  # the head changes the drafts
    # a DDTree over the head is refused by name
    options = ProposerOptions(tree=True)
    with pytest.raises(UsageError, match="--tree: a DDTree over Domino's correction head is not implemented"):
        domino_kind.proposer(drafter, domino_kind.make_record(drafter.config, "t", []), target, options)


def test_sampled_chains_return_the_distributions_given_the_drafts_before(one_thread):
    target, drafter = setup(1)
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    proposer = DominoProposer(drafter, embedding, head)
    prompt = torch.randint(0, 127, (9,), generator=torch.Generator().manual_seed(1))
    result = speculative_generate(target, prompt, proposer, 4, 20, temperature=0.8, generator=torch.Generator())
    assert len(result.tokens) == 20
    hidden = {i: torch.randn(3, 32, dtype=torch.float64) for i in drafter.config.target_layers}
    proposer.reset()
    tokens = torch.tensor([3, 8, 1, 44])
    tree = proposer.propose(ProposalContext(tokens, 4, 0.8, torch.Generator().manual_seed(3), 128, hidden))
    base = proposer.slot_hidden @ head.t()
    seen = [int(tokens[-1])]
    for k in range(4):  # each distribution is slot k's corrected softmax after the drafts before it
        row = base[k]
        if k >= 1:
            row = row + delta(drafter, proposer.slot_hidden[k], gru_states(drafter, embedding[torch.tensor(seen)])[-1])
        torch.testing.assert_close(tree.probs[k].double(), torch.softmax(row / 0.8, -1), rtol=1e-6, atol=1e-9)
        seen.append(int(tree.tokens[k]))


def test_the_domino_export_is_specforges_layout_and_reloads_with_identical_logits(tmp_path, one_thread):
    target, drafter = setup(2)
    drafter = drafter.float()
    record = domino_kind.make_record(drafter.config, "some/target", ["LlamaForCausalLM"])
    assert record.kind == "domino"
    folder = domino_kind.DOMINO.write(drafter, record, tmp_path / "domino")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DominoDraftModel"] and config["emb_dim"] == 5
    assert config["dflash_config"] == {
        "mask_token_id": 127, "target_layer_ids": [0, 2], "block_size": 5, "projector_type": "domino",
        "emb_dim": 5, "gru_hidden_dim": 6, "pure_draft_prefix_len": 1, "shift_label": False,
    }  # fmt: skip
    tensors = load_file(str(next(folder.glob("*.safetensors"))))
    assert tensors["prefix_gru.weight_ih_l0"].shape == (18, 32) and tensors["prefix_gru.weight_hh_l0"].shape == (18, 6)
    assert tensors["embed_proj.0.weight"].shape == (5, 38) and tensors["embed_proj.2.weight"].shape == (128, 5)
    assert "fc.weight" in tensors and not any("embed_tokens" in k or "lm_head" in k for k in tensors)
    assert domino_kind.DOMINO.recognise(folder) and not dflash_kind.ZLAB.recognise(folder)
    again, again_record = domino_kind.DOMINO.load(folder)
    assert isinstance(again, DominoDrafter) and again.config == drafter.config and again_record.kind == "domino"
    # SpecForge's own config keys (qwen3-8b-domino.json's set, scaled down): read the same
    specforge = {k: v for k, v in config.items() if k not in ("torch_dtype", "rope_parameters")}
    specforge["dflash_config"] = {k: v for k, v in config["dflash_config"].items() if k != "block_size"}
    specforge.update(auto_map={"AutoModel": "domino.DominoDraftModel"}, bos_token_id=0, eos_token_id=1,
                     initializer_range=0.02, max_window_layers=2, use_cache=True, use_sliding_window=False,
                     sliding_window=None, rope_scaling=None)  # fmt: skip
    (folder / "config.json").write_text(json.dumps(specforge))
    read, _ = domino_kind.DOMINO.load(folder)
    assert read.config == drafter.config
    embedding, head = target.get_input_embeddings().weight.float(), target.get_output_embeddings().weight.float()
    hidden = {i: torch.randn(6, 32) for i in drafter.config.target_layers}
    tokens = torch.tensor([5, 9, 17, 4, 60, 33, 2])
    chains = []
    for d in (drafter, again, read):
        proposer = DominoProposer(d, embedding, head)
        chains.append(proposer.draft_chain(SimpleNamespace(tokens=tokens, temperature=0.0), proposer.block_logits(
            ProposalContext(tokens=tokens, k=4, vocab_size=128, hidden_states=hidden))[:4]))  # fmt: skip
    for other in chains[1:]:
        assert torch.equal(chains[0][0], other[0]) and torch.equal(chains[0][2], other[2])  # drafts, corrected logits
    assert set(HEAD_KEYS) <= set(config["dflash_config"])
    # the DFlash formats have no field for the head
    for fmt in (dflash_kind.ZLAB, dflash_kind.SPECULATORS):
        with pytest.raises(ModelFolderError, match="no field for the heads of a DominoDrafter"):
            fmt.write(drafter, record, tmp_path / fmt.name)


def test_bad_input_is_refused_naming_the_value(tmp_path):
    save_target(tmp_path / "target")
    path = str(tmp_path / "target")
    options = dict(num_draft_layers=1, block_size=4, mask_token_id=V - 1)
    with pytest.raises(RecipeError, match=r"model.emb_dim=0 must be an integer >= 1"):
        Domino(path, emb_dim=0, **options)
    with pytest.raises(RecipeError, match=r"model.pure_draft_prefix_len=3 must be an integer in 0..2"):
        Domino(path, pure_draft_prefix_len=3, **options)
    with pytest.raises(RecipeError, match=r"model.lambda_base_start=1.5 must be in \[0, 1\]"):
        Domino(path, lambda_base_start=1.5, **options)
    with pytest.raises(RecipeError, match=r"model.lambda_base_decay_ratio=0.0 must be in \(0, 1\]"):
        Domino(path, lambda_base_decay_ratio=0.0, **options)
    _, drafter = setup(0)
    folder = domino_kind.DOMINO.write(drafter.float(), domino_kind.make_record(drafter.config, "t", []), tmp_path / "d")
    config = json.loads((folder / "config.json").read_text())

    def load_with(**changes):
        inner = {k: v for k, v in {**config["dflash_config"], **changes}.items() if v is not None}
        (folder / "config.json").write_text(json.dumps({**config, "dflash_config": inner}))
        return domino_kind.DOMINO.load(folder)[0]

    with pytest.raises(ModelFolderError, match=r"dflash_config.shift_label True: the anchor slot drafting"):
        load_with(shift_label=True)
    with pytest.raises(ModelFolderError, match=r"projector_type 'dspark', expected 'domino'"):
        load_with(projector_type="dspark")
    with pytest.raises(ModelFolderError, match=r"emb_dim 5 and dflash_config.emb_dim 4 differ"):
        load_with(emb_dim=4)
    assert load_with(pure_draft_prefix_len=None).config.pure_draft_prefix_len == 0  # absent: SpecForge's default
    assert load_with(emb_dim=None).config.emb_dim == 5  # from the top level


def test_init_from_a_plain_dflash_adds_the_head_and_keeps_the_backbone(tmp_path):
    save_target(tmp_path / "target")
    path = str(tmp_path / "target")
    plain = DFlash(path, num_draft_layers=1, target_layers=[1, 3], block_size=4, mask_token_id=V - 1)
    record = dflash_kind.make_record(plain.drafter.config, path, ["LlamaForCausalLM"])
    folder = dflash_kind.ZLAB.write(plain.drafter, record, tmp_path / "plain")
    grown = Domino(path, init_from=str(folder), block_size=4, **HEAD)
    assert isinstance(grown.drafter, DominoDrafter) and grown.drafter_record().kind == "domino"
    assert (grown.drafter.config.emb_dim, grown.drafter.config.gru_hidden_dim) == (5, 6)
    state = grown.drafter.state_dict()
    for name, tensor in plain.drafter.state_dict().items():
        assert torch.equal(state[name], tensor), name
    assert {k for k in state if k not in plain.drafter.state_dict()} == {
        "prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight",
    }  # fmt: skip


def test_sharded_weights_are_refused(tmp_path, monkeypatch):
    objective = objective_of(tmp_path)
    monkeypatch.setattr(objective, "weights_are_sharded", lambda: True)
    ids = torch.randint(0, V - 1, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RecipeError, match="FSDP2 and ZeRO-3 shard; train it with DDP or on one device"):
        objective.compute_loss({"input_ids": ids, "loss_mask": torch.ones(1, 8, dtype=torch.bool)})


@pytest.mark.parametrize("prefix", [1, 0])
def test_training_and_drafting_give_the_same_corrected_logits_when_the_data_is_the_drafts(prefix, tmp_path, one_thread):
    """One block through both paths: the proposer drafts it left to right after a prompt; the objective, trained on
    the prompt followed by those drafts (teacher forcing on the drafted tokens), computes the same slots' corrected
    logits from the same drafter. Every slot's head inputs (the slot's output, the GRU's state after the root and the
    drafts before it) are then the same on both sides, so are the logits, and each draft is its training row's
    argmax."""
    objective = objective_of(tmp_path, pure_draft_prefix_len=prefix)
    drafter, b = objective.drafter, objective.drafter.config.block_size
    embedding, head = objective.embedding_weight(), objective.target.lm_head_weight
    a, S = 7, 7 + b  # the anchor (the round's root) and a row that holds its whole block
    ids = torch.randint(0, V - 1, (1, S), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = objective.target.model.get_decoder()(input_ids=ids, output_hidden_states=True)
    hidden = {i: out.hidden_states[i][0, :a] for i in drafter.config.target_layers}  # positions 0..a-1
    proposer = DominoProposer(drafter, embedding, head)
    context = ProposalContext(tokens=ids[0, : a + 1], k=b - 1, vocab_size=V, hidden_states=hidden)
    with torch.no_grad():
        drafts, _, rows, _ = proposer.draft_chain(context, proposer.block_logits(context)[: b - 1])  # [b-1], [b-1, V]
    plain = proposer.slot_hidden @ head.t()  # [b - 1, V] the backbone's logits: the head must change some
    assert not torch.allclose(rows[prefix:], plain[prefix:], atol=1e-3)
    torch.testing.assert_close(rows[:prefix], plain[:prefix])
    forced = ids.clone()
    forced[0, a + 1 :] = drafts  # the data after the root is the drafts
    seen = {}

    def capture(hidden, bias, *args):  # the slot loss's inputs: every trained slot's output and its logit bias
        seen.setdefault("logits", hidden @ head.t() + bias.features @ bias.weight.t())  # [n, V]: the first term's
        return original(hidden, bias, *args)

    original = objective._slot_losses
    objective._slot_losses = capture
    objective.anchors = lambda trained, stage: (torch.tensor([[a]]), torch.tensor([[True]]))
    with torch.no_grad():
        objective.compute_loss({"input_ids": forced, "loss_mask": torch.ones(1, S, dtype=torch.bool)})
    trained = seen["logits"]  # [b - 1, V]: slots 1..b-1 of the block at a
    assert trained.shape == rows.shape
    torch.testing.assert_close(trained, rows, rtol=1e-4, atol=1e-4)
    assert torch.equal(trained.argmax(-1), drafts)  # teacher forcing on the drafts reproduces each draft


def test_a_new_head_starts_as_plain_dflash_and_trains_from_there(tmp_path, monkeypatch, one_thread):
    """The delta's output projection starts at zero: a new drafter's corrected logits are its backbone's, in drafting
    and in training (the curriculum's two terms equal), and the first step's gradient reaches that projection."""
    save_target(tmp_path / "target")
    objective = Domino(
        str(tmp_path / "target"), num_draft_layers=1, target_layers=[1, 3], block_size=5, mask_token_id=V - 1,
        max_anchors=3, labels="data", **HEAD,
    )  # fmt: skip
    drafter = objective.drafter
    assert not drafter.embed_proj[2].weight.any() and drafter.embed_proj[0].weight.std() > 0
    embedding, head = objective.embedding_weight(), objective.target.lm_head_weight
    hidden = {i: torch.randn(6, 16) for i in drafter.config.target_layers}
    tokens = torch.tensor([5, 9, 17, 4, 60, 33, 2])
    proposer = DominoProposer(drafter, embedding, head)
    context = ProposalContext(tokens=tokens, k=4, vocab_size=V, hidden_states=hidden)
    with torch.no_grad():
        drafts, _, rows, _ = proposer.draft_chain(context, proposer.block_logits(context)[:4])
    assert torch.equal(rows, proposer.slot_hidden[:4] @ head.t())
    drafter.train()
    monkeypatch.setattr(objective, "schedule_position", lambda: (1, 10))  # lambda 0.8: both terms computed
    ids = torch.randint(0, V - 1, (2, 12), generator=torch.Generator().manual_seed(2))
    loss, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": torch.ones(2, 12, dtype=torch.bool)})
    assert float(metrics["loss_final"]) == float(metrics["loss_base"])
    loss.backward()
    assert drafter.embed_proj[2].weight.grad.abs().sum() > 0
