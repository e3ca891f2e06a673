"""DSpark, DFlash's block refiner (trainer/methods/dspark/): the loss against a naive reference (each block drafted
alone, the Markov bias of the data's previous token, the confidence head's cross entropy against 1 - TV of the draft
and target distributions), chain and tree drafting lossless and resolved left to right, the ``dspark`` export
reloaded with identical logits, bad input refused naming the value, ``init_from`` between DFlash and DSpark, and a
checkpoint or recipe of the time DSpark was an option of DFlash read or refused naming the new class."""

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
from trainer.decoding.options import ProposerOptions
from trainer.decoding.proposers import NoProposer, ProposalContext
from trainer.interface.errors import ModelFolderError, RecipeError, UsageError
from trainer.interface.renamed_keys import WHY_MOVED
from trainer.methods.dflash import kind as dflash_kind
from trainer.methods.dflash.module import DFlashConfig
from trainer.methods.dflash.objective import DFlash
from trainer.methods.dflash.proposer import DFlashProposer
from trainer.methods.dspark import kind as dspark_kind
from trainer.methods.dspark.module import HEAD_KEYS, DSparkConfig, DSparkDrafter
from trainer.methods.dspark.objective import DSpark
from trainer.methods.dspark.proposer import DSparkProposer, DSparkTreeProposer
from trainer.training.recipe import DraftsmithCLI, parse_recipe
from trainer.training.registry import get_kind, load_drafter

HEADS = dict(markov_rank=6, enable_confidence_head=True, confidence_head_with_markov=True)
NO_HEADS = dict(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False)


def naive_dspark_loss(objective: DSpark, ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[float, float]:
    """(total loss, confidence loss): the data-label slot losses with the Markov bias of the data's previous token,
    weighted exp(-(k - 1) / gamma) and normalised by the weights, plus alpha times the confidence head's BCE against
    sum_v min(q_v, p_v), weighted exp(-(k - 1) / gamma) and averaged over the slots."""
    drafter, target = objective.drafter, objective.target
    c = drafter.config
    b, (B, S) = c.block_size, ids.shape
    trained = F.pad(loss_mask[:, :-1], (1, 0), value=False)
    anchors, keep = objective.anchors(trained, "train")
    out = target.model(ids, output_hidden_states=True)
    head, embedding = target.lm_head_weight, objective.embedding_weight()
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight  # [V, r] each
    proj = drafter.confidence_head.proj
    total = weights = bce = 0.0
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
            for k in range(1, b):
                p = a + k
                if p >= S or not trained[r, p]:
                    continue
                prev = int(ids[r, p - 1])
                logits = slots[k] @ head.t() + w2 @ w1[prev]  # [V]
                w = math.exp(-(k - 1) / objective.gamma)
                total += w * float(F.cross_entropy(logits[None], ids[r, p][None]))
                weights += w
                accept = torch.minimum(logits.softmax(-1), out.logits[r, p - 1].softmax(-1)).sum()
                confidence = proj.weight[0] @ torch.cat([slots[k], w1[prev]]) + proj.bias[0]
                bce += w * float(F.binary_cross_entropy_with_logits(confidence, accept))
                n += 1
    confidence_loss = bce / n
    return total / weights + objective.confidence_alpha * confidence_loss, confidence_loss


def test_the_loss_equals_blocks_drafted_alone_with_the_heads(tmp_path):
    save_target(tmp_path / "target")
    objective = DSpark(
        str(tmp_path / "target"), num_draft_layers=1, target_layers=[1, 3], block_size=4, mask_token_id=V - 1,
        max_anchors=3, labels="data", loss_chunk_size=4, confidence_head_alpha=0.7, **HEADS,
    )  # fmt: skip
    for p in objective.drafter.parameters():
        nn.init.normal_(p, std=0.3)
    ids = torch.randint(0, V - 1, (2, 11), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.ones(2, 11, dtype=torch.bool)
    loss_mask[0, :4] = False
    with torch.no_grad():
        loss, metrics = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
        expected, confidence_loss = naive_dspark_loss(objective, ids, loss_mask)
    torch.testing.assert_close(float(loss), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(float(metrics["confidence_loss"]), confidence_loss, rtol=1e-5, atol=0)
    assert 0.0 < float(metrics["accept_rate"]) < 1.0 and 0.0 < float(metrics["confidence_pred_mean"]) < 1.0
    loss, _ = objective.compute_loss({"input_ids": ids, "loss_mask": loss_mask})
    loss.backward()  # both heads train (the confidence head's features are not detached, as in speculators)
    heads = (objective.drafter.markov_head.markov_w1, objective.drafter.markov_head.markov_w2)
    assert all(m.weight.grad.abs().sum() > 0 for m in (*heads, objective.drafter.confidence_head.proj))


def setup(seed: int = 0, **heads) -> tuple[nn.Module, DSparkDrafter]:
    target = tiny_llama(seed, vocab=128, layers=4)  # float64, eval
    config = DFlashConfig.from_target(target.config, 2, (1, 3), block_size=5, mask_token_id=127)
    config = DSparkConfig(**{**config.to_dict(), **(heads or HEADS)})
    torch.manual_seed(seed)
    drafter = DSparkDrafter(config)
    for p in drafter.parameters():
        nn.init.normal_(p, std=0.3)
    return target, drafter.to(torch.float64).eval()


def test_chains_and_trees_are_lossless_and_resolve_the_markov_bias_left_to_right(one_thread):
    target, drafter = setup()
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    prompt = torch.randint(0, 127, (11,), generator=torch.Generator().manual_seed(0))
    alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=30).tokens
    chain = DSparkProposer(drafter, embedding, head)
    for proposer in (chain, DSparkTreeProposer(drafter, embedding, head, top_k=3, budget=10)):
        assert speculative_generate(target, prompt, proposer, k=4, max_new_tokens=30).tokens == alone
    # one round by hand: slot k's draft is the argmax of its logits plus the bias of slot k - 1's draft
    hidden = {i: torch.randn(6, 32, dtype=torch.float64) for i in drafter.config.target_layers}
    chain.reset()
    tokens = torch.tensor([5, 9, 17, 4, 60, 33, 2])
    drafts = chain.propose(ProposalContext(tokens=tokens, k=4, vocab_size=128, hidden_states=hidden)).tokens
    base = chain.slot_hidden @ head.t()  # [b - 1, V]
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    prev, expected, confidence = int(tokens[-1]), [], []
    for k in range(4):
        logits = base[k] + w2 @ w1[prev]
        features = torch.cat([chain.slot_hidden[k], w1[prev]])
        confidence.append(
            torch.sigmoid(drafter.confidence_head.proj.weight[0] @ features + drafter.confidence_head.proj.bias[0])
        )
        prev = int(logits.argmax())
        expected.append(prev)
    assert drafts.tolist() == expected
    torch.testing.assert_close(chain.slot_acceptance().double(), torch.stack(confidence), rtol=1e-5, atol=1e-6)
    plain = (base[:4].argmax(-1)).tolist()
    assert plain != expected  # the heads change the drafts of these random weights (else the check above is void)


def test_sampled_chains_return_the_distributions_given_the_drafts_before(one_thread):
    target, drafter = setup(1)
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    proposer = DSparkProposer(drafter, embedding, head)
    prompt = torch.randint(0, 127, (9,), generator=torch.Generator().manual_seed(1))
    result = speculative_generate(target, prompt, proposer, 4, 20, temperature=0.8, generator=torch.Generator())
    assert len(result.tokens) == 20
    hidden = {i: torch.randn(3, 32, dtype=torch.float64) for i in drafter.config.target_layers}
    proposer.reset()
    tokens = torch.tensor([3, 8, 1, 44])
    ctx = ProposalContext(tokens, 4, 0.8, torch.Generator().manual_seed(3), 128, hidden)
    tree = proposer.propose(ctx)
    base = proposer.slot_hidden @ head.t()
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    prev = int(tokens[-1])
    for k in range(4):  # each distribution is slot k's biased softmax after the draft before it
        expected = torch.softmax((base[k] + w2 @ w1[prev]) / 0.8, dim=-1)
        torch.testing.assert_close(tree.probs[k].double(), expected, rtol=1e-5, atol=1e-7)
        prev = int(tree.tokens[k])


@pytest.mark.parametrize(
    "heads",
    [HEADS, {**NO_HEADS, "markov_rank": 3}, {**NO_HEADS, "enable_confidence_head": True}, NO_HEADS],
)
def test_the_dspark_export_reloads_with_identical_logits(heads, tmp_path):
    target, drafter = setup(2, **heads)
    drafter = drafter.float()
    record = dspark_kind.make_record(drafter.config, "some/target", ["LlamaForCausalLM"])
    assert record.kind == "dspark"
    folder = dspark_kind.DSPARK.write(drafter, record, tmp_path / "dspark")
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["DSparkSpeculator"]
    assert config["sample_from_anchor"] is False
    for key in HEAD_KEYS:
        assert config[key] == getattr(drafter.config, key)
    assert dspark_kind.DSPARK.recognise(folder) and not dflash_kind.SPECULATORS.recognise(folder)
    again, again_record = dspark_kind.DSPARK.load(folder)
    assert again_record.target == "some/target" and again.config == drafter.config
    assert again_record.kind == "dspark" and isinstance(again, DSparkDrafter)
    embedding = target.get_input_embeddings().weight.float()
    x = F.embedding(torch.tensor([[7, 127, 127, 127, 127]]), embedding)
    past = drafter.context_kv(torch.randn(1, 6, 32), torch.arange(6)[None])
    prev = torch.tensor([[7, 3, 9, 11, 2]])
    with torch.no_grad():
        outs = [d.draft(x, torch.arange(6, 11)[None], past) for d in (drafter, again)]
        heads_out = [d.apply_heads(o, o @ embedding.t(), prev) for d, o in zip((drafter, again), outs)]
    assert torch.equal(heads_out[0][0], heads_out[1][0])
    if drafter.confidence_head is not None:
        assert torch.equal(heads_out[0][1], heads_out[1][1])
    # the DFlash formats have no fields for the heads: draftsmith export lists the kind's one format, and DFlash's
    # writers refuse the heads
    with pytest.raises(UsageError, match=r"kind 'dspark' cannot be written as 'dflash'; it writes: dspark \("):
        get_kind(record.kind, "test").format("dflash")
    for fmt in (dflash_kind.ZLAB, dflash_kind.SPECULATORS):
        with pytest.raises(ModelFolderError, match="no field for the heads of a DSparkDrafter") as err:
            fmt.write(drafter, record, tmp_path / fmt.name)
        assert "its own kind's format" in (err.value.hint or "")


def test_bad_input_is_refused_naming_the_value(tok, tmp_path):
    save_target(tmp_path / "target")
    path = str(tmp_path / "target")
    options = dict(num_draft_layers=1, block_size=4, mask_token_id=V - 1)
    with pytest.raises(RecipeError, match=r"model.markov_rank=-1 must be an integer >= 0"):
        DSpark(path, markov_rank=-1, **options)
    with pytest.raises(RecipeError, match=r"model.markov_head_type='gated' is not implemented.*use 'vanilla'"):
        DSpark(path, markov_rank=4, markov_head_type="gated", **options)
    with pytest.raises(RecipeError, match=r"model.confidence_head_with_markov=True needs enable_confidence_head"):
        DSpark(path, markov_rank=0, enable_confidence_head=True, confidence_head_with_markov=True, **options)
    with pytest.raises(RecipeError, match=r"model.confidence_head_alpha=-1.0 must be >= 0"):
        DSpark(path, enable_confidence_head=True, confidence_head_alpha=-1.0, **options)
    # DSpark of a target whose embedding has no row the tokenizer leaves unused: the mask token must be named
    save_target(tmp_path / "full", vocab=len(tok), tokenizer=tok)
    with pytest.raises(RecipeError, match=r"mask_token_id is not set and the target's embedding has no row past"):
        DSpark(str(tmp_path / "full"), num_draft_layers=1, **HEADS)
    # a DSpark folder: speculators' other head types, and its default sample_from_anchor (true), refused by name
    _, drafter = setup(0)
    record = dspark_kind.make_record(drafter.config, "t", [])
    folder = dspark_kind.DSPARK.write(drafter.float(), record, tmp_path / "dspark")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "markov_head_type": "rnn"}))
    with pytest.raises(ModelFolderError, match=r"markov_head_type='rnn' is not implemented"):
        dspark_kind.DSPARK.load(folder)
    del config["sample_from_anchor"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match=r"sample_from_anchor true: \(absent: speculators dspark default\)"):
        dspark_kind.DSPARK.load(folder)


def test_dynamic_draft_length_reads_the_confidence_head(one_thread):
    """With an acceptance threshold (trainer/decoding/proposers.py, dynamic draft length) the chain carries the
    confidence head's predictions and the DDTree the drafter's probabilities; decoding stays lossless."""
    target, drafter = setup(3)
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    chain = DSparkProposer(drafter, embedding, head)
    tree_proposer = DSparkTreeProposer(drafter, embedding, head, top_k=2, budget=6)
    assert chain.estimates_acceptance and tree_proposer.estimates_acceptance
    hidden = {i: torch.randn(6, 32, dtype=torch.float64) for i in drafter.config.target_layers}
    tokens = torch.tensor([5, 9, 17, 4, 60, 33, 2])
    tree = chain.propose(ProposalContext(tokens, 4, vocab_size=128, hidden_states=hidden, accept_threshold=0.3))
    assert torch.equal(tree.confidence, chain.slot_acceptance())
    tree_proposer.reset()
    nodes = tree_proposer.propose(
        ProposalContext(tokens, 4, vocab_size=128, hidden_states=hidden, accept_threshold=0.3)
    )
    assert nodes.confidence is not None and ((nodes.confidence > 0) & (nodes.confidence <= 1)).all()
    prompt = torch.randint(0, 127, (11,), generator=torch.Generator().manual_seed(2))
    alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=24).tokens
    for proposer in (chain, tree_proposer):
        result = speculative_generate(target, prompt, proposer, k=4, max_new_tokens=24, accept_threshold=0.3)
        assert result.tokens == alone


def test_init_from_a_plain_dflash_adds_the_heads_and_keeps_the_backbone(tmp_path):
    save_target(tmp_path / "target")
    path = str(tmp_path / "target")
    plain = DFlash(path, num_draft_layers=1, target_layers=[1, 3], block_size=4, mask_token_id=V - 1)
    record = dflash_kind.make_record(plain.drafter.config, path, ["LlamaForCausalLM"])
    folder = dflash_kind.SPECULATORS.write(plain.drafter, record, tmp_path / "plain")
    grown = DSpark(path, init_from=str(folder), block_size=4, **HEADS)
    assert grown.drafter.config.markov_rank == 6 and grown.drafter.config.enable_confidence_head
    assert grown.drafter_record().kind == "dspark"
    state = grown.drafter.state_dict()
    for name, tensor in plain.drafter.state_dict().items():
        assert torch.equal(state[name], tensor), name
    assert {k for k in state if k not in plain.drafter.state_dict()} == {
        "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    }  # fmt: skip


def test_init_from_a_dspark_drafter_gives_dflash_its_backbone_and_dspark_its_heads(tmp_path, caplog):
    save_target(tmp_path / "target")
    path = str(tmp_path / "target")
    options = dict(num_draft_layers=1, target_layers=[1, 3], block_size=4, mask_token_id=V - 1)
    dspark = DSpark(path, **options, **HEADS)
    record = dspark.drafter_record()
    folder = dspark_kind.DSPARK.write(dspark.drafter, record, tmp_path / "dspark")
    plain = DFlash(path, init_from=str(folder), block_size=4)
    assert type(plain.drafter) is not DSparkDrafter and plain.drafter_record().kind == "dflash"
    state = dspark.drafter.state_dict()
    kept = plain.drafter.state_dict()
    assert set(state) - set(kept) == {k for k in state if k.startswith(("markov_head.", "confidence_head."))}
    assert all(torch.equal(kept[k], state[k]) for k in kept)
    assert "not carried over" in caplog.text
    again = DSpark(path, init_from=str(folder), block_size=4, **HEADS)  # its own heads: the drafter read as it is
    assert all(torch.equal(again.drafter.state_dict()[k], v) for k, v in state.items())
    smaller = DSpark(path, init_from=str(folder), block_size=4, **{**HEADS, "markov_rank": 3})
    resized = smaller.drafter.state_dict()
    assert resized["markov_head.markov_w1.weight"].shape == (V, 3)
    assert smaller.drafter.confidence_head.proj.weight.shape == (1, 16 + 3)  # reads the new Markov embedding
    reshaped = ("markov_head.", "confidence_head.proj.weight")
    assert all(torch.equal(resized[k], v) for k, v in state.items() if not k.startswith(reshaped))


OLD_DFLASH = "trainer.methods.dflash.objective.DFlash"
NEW_DSPARK = "trainer.methods.dspark.objective.DSpark"
ROOT = Path(__file__).resolve().parents[2]
UNSET = {"markov_rank": 0, "markov_head_type": "vanilla", "enable_confidence_head": False}


def test_a_checkpoint_of_dflash_with_heads_loads_as_dspark(tmp_path, one_thread):
    """Before DSpark had its own kind its checkpoints recorded kind dflash with the heads' fields in the config (a
    plain DFlash's at the values that build no head): the first loads as kind dspark, the second as dflash."""
    save_target(tmp_path / "target")
    path = str(tmp_path / "target")
    options = dict(num_draft_layers=1, target_layers=[1, 3], block_size=4, mask_token_id=V - 1)
    for objective, old_config in (
        (DSpark(path, **options, **HEADS), None),
        (DFlash(path, **options), {**UNSET, "confidence_head_with_markov": False}),
    ):
        record = objective.drafter_record().to_dict()
        record = {**record, "kind": "dflash", "config": {**record["config"], **(old_config or {})}}
        state = {f"drafter.{k}": v for k, v in objective.drafter.state_dict().items()}
        file = tmp_path / f"{type(objective).__name__}.ckpt"
        torch.save({"state_dict": state, "drafter": record}, file)
        drafter, read = load_drafter(str(file))
        assert read.kind == objective.drafter_record().kind and read.config == objective.drafter_record().config
        assert type(drafter) is type(objective.drafter)
        assert all(torch.equal(drafter.state_dict()[k.removeprefix("drafter.")], v) for k, v in state.items())
        proposer = get_kind(read.kind, "test").proposer(drafter, read, objective.target.model, ProposerOptions())
        assert type(proposer) is (DSparkProposer if read.kind == "dspark" else DFlashProposer)


def test_a_dflash_recipe_with_dspark_options_is_refused_naming_the_new_class(tmp_path):
    recipe = yaml.safe_load((ROOT / "recipes" / "quickstart" / "dspark.yaml").read_text())
    assert recipe["model"]["class_path"] == NEW_DSPARK
    recipe["model"]["class_path"] = OLD_DFLASH
    file = tmp_path / "old_dspark.yaml"
    file.write_text(yaml.safe_dump(recipe))
    with pytest.raises(RecipeError) as err:
        parse_recipe([str(file)])
    key = str(err.value).removeprefix("model.init_args.").split(" ", 1)[0]  # the first the parser met
    assert key in (*HEAD_KEYS, "confidence_head_alpha")
    assert str(err.value) == (
        f"model.init_args.{key} is an option of {NEW_DSPARK} now: set model.class_path to {NEW_DSPARK} ({WHY_MOVED})"
    )
    with pytest.raises(RecipeError, match=rf"^model.init_args.markov_rank is an option of {NEW_DSPARK} now"):
        parse_recipe([str(ROOT / "recipes" / "quickstart" / "dflash.yaml")], ["--model.init_args.markov_rank", "8"])


class _Parsed(Exception):
    pass


class _ResumeReader(DraftsmithCLI):
    """``draftsmith fit``'s CLI, stopped once the recipe and a ``--ckpt_path`` file's hyper-parameters are parsed."""

    def before_instantiate_classes(self) -> None:
        raise _Parsed(self.config)


@pytest.mark.parametrize("heads", [True, False], ids=["dspark", "plain"])
def test_a_checkpoint_of_dflash_with_dspark_options_resumes_as_the_class_that_has_them(heads, tmp_path):
    """Hyper-parameters LightningCLI saved with a DFlash run when DSpark's heads were its options: with a head they
    resume as DSpark with the values recorded; without, as DFlash without the options."""
    recorded = {"target": "artifacts/old_target", "block_size": 8, "labels": "hard", "confidence_head_alpha": 0.5}
    recorded |= HEADS if heads else {**UNSET, "confidence_head_with_markov": False}
    ckpt = tmp_path / "old.ckpt"
    instantiator = {"_class_path": OLD_DFLASH, "_instantiator": "lightning.pytorch.cli.instantiate_module"}
    torch.save({"hyper_parameters": {**instantiator, **recorded}, "state_dict": {}}, ckpt)
    recipe = str(ROOT / "recipes" / "quickstart" / ("dspark.yaml" if heads else "dflash.yaml"))
    with pytest.raises(_Parsed) as parsed:
        _ResumeReader(["fit", "--config", recipe, "--seed_everything", "0", "--ckpt_path", str(ckpt)])
    model = parsed.value.args[0].fit.model
    assert model.init_args["labels"] == "data"  # DFlash's renamed value, read in its new spelling as before
    args = model.init_args.as_dict()
    if heads:
        expected = {**HEADS, "confidence_head_alpha": 0.5}
        assert model.class_path == NEW_DSPARK and {k: args[k] for k in expected} == expected
    else:
        assert model.class_path == OLD_DFLASH and not {*HEAD_KEYS, "confidence_head_alpha"} & set(args)
