"""Document masking in the drafters' objectives (EAGLE-3, P-EAGLE, DFlash and DFlash's children): the loss of a packed
row of documents, with its document_ids, is the token-weighted combination of each document's loss computed alone (a
row of its own); with one document, document_ids change nothing; a short real fit runs with data.document_masking."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.integration.test_eagle3_offline import tiny_llama as saved_llama
from tests.recipe_runs import data_overrides, fit, merge, save_random_target, trainer_overrides
from tests.unit.test_dflash_objective import V, save_target

pytestmark = pytest.mark.usefixtures("one_thread")


def packed(lengths: list[int], vocab: int, seed: int = 0, untrained: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """One packed row [1, S] of documents of these lengths as TextDataModule serves it with document masking: a
    document's last position (whose label is the next document's first token) untrained, and the ``untrained``
    positions too."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 1, (1, sum(lengths)), generator=generator)  # [1, S], never the last id
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]  # [1, S]
    loss_mask = torch.ones_like(ids, dtype=torch.bool)  # [1, S]
    loss_mask[0, :-1] = documents[0, 1:] == documents[0, :-1]
    loss_mask[0, list(untrained)] = False
    return {"input_ids": ids, "loss_mask": loss_mask, "document_ids": documents}


def alone(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Every document of the packed row as a row of its own, without document_ids."""
    row = batch["document_ids"][0].tolist()
    starts = [t for t in range(len(row)) if t == 0 or row[t] != row[t - 1]] + [len(row)]
    spans = [slice(starts[i], starts[i + 1]) for i in range(len(starts) - 1)]
    return [{key: batch[key][:, span] for key in ("input_ids", "loss_mask")} for span in spans]


def without_documents(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in batch.items() if key != "document_ids"}


def assert_one_document_changes_nothing(objective, batch: dict[str, torch.Tensor]) -> None:
    """document_ids of a single document give the loss and metrics of a batch without them."""
    one = without_documents(batch) | {"document_ids": torch.zeros_like(batch["input_ids"])}
    loss, metrics = objective.compute_loss(one)
    plain, plain_metrics = objective.compute_loss(without_documents(batch))
    torch.testing.assert_close(loss, plain, rtol=1e-5, atol=1e-6)
    assert metrics.keys() == plain_metrics.keys()
    for key in metrics:
        torch.testing.assert_close(metrics[key], plain_metrics[key], rtol=1e-5, atol=1e-6, msg=key)


# -------------------------------------------------------------------------------------------------------- EAGLE-3


def eagle3_trained(loss_mask: torch.Tensor, step: int) -> torch.Tensor:
    """[S - 1 - step] bool, a loop: element t of a row alone trains at TTT step i when its label position t + 1 + i
    is in the row and trained."""
    S = loss_mask.shape[1]
    return torch.tensor([bool(loss_mask[0, t + 1 + step]) for t in range(S - 1 - step)], dtype=torch.bool)


@pytest.mark.parametrize(("labels", "loss"), [("soft", "kl"), ("soft", "tv"), ("argmax", "kl")])
def test_eagle3_loss_of_a_packed_row_is_each_documents_own(tmp_path, labels, loss):
    """Per TTT step i: loss_i and acc_i (alpha_i for tv) of the packed row times its trained elements equal the sum
    over its documents of the same alone (the loss of step i is the mean over its trained elements); without
    document_ids the packed row trains across documents and differs."""
    from trainer.methods.eagle3.objective import Eagle3

    K = 3
    saved_llama(tmp_path / "target", tied=False)  # vocab 64
    objective = Eagle3(str(tmp_path / "target"), draft_vocab_size=32, target_layers=[0, 1, 2], ttt_steps=K,
                       labels=labels, loss=loss)  # fmt: skip
    rows = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    objective.build_vocab_map(rows.numpy(), (rows > 4).numpy())
    torch.nn.init.normal_(objective.drafter.midlayer.self_attn.o_proj.weight, std=0.5)  # drafts that depend on inputs
    batch = packed([7, 4, 9], vocab=64, untrained=(13,))
    docs = alone(batch)
    with torch.no_grad():
        _, metrics = objective.compute_loss(batch)
        own = [objective.compute_loss(doc)[1] for doc in docs]
        _, crossing = objective.compute_loss(without_documents(batch))
        for i in range(K):
            trained = [eagle3_trained(doc["loss_mask"], i) for doc in docs]  # [L - 1 - i] each
            counted = trained  # the positions the loss of step i averages over
            if labels == "argmax":  # only where the target's argmax (over every token) is in the draft vocabulary
                counted = [
                    m & objective.drafter.t2d[objective.target(doc["input_ids"]).logits[0, 1 + i :].argmax(-1)]
                    for m, doc in zip(trained, docs, strict=True)
                ]
            weight = [float(m.sum()) for m in counted]
            want = sum(float(o[f"loss_{i}"]) * w for o, w in zip(own, weight, strict=True))
            assert float(metrics[f"loss_{i}"]) * sum(weight) == pytest.approx(want, rel=1e-5, abs=1e-6)
            names = ["acc"] + (["alpha"] if loss == "tv" else [])
            for name in names:
                weight = [float(m.sum()) for m in trained]
                want = sum(float(o[f"{name}_{i}"]) * w for o, w in zip(own, weight, strict=True))
                assert float(metrics[f"{name}_{i}"]) * sum(weight) == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert any(
            float(crossing[f"loss_{i}"]) != pytest.approx(float(metrics[f"loss_{i}"]), rel=1e-4) for i in range(K)
        )
        assert_one_document_changes_nothing(objective, batch)


# -------------------------------------------------------------------------------------------------------- P-EAGLE


def peagle_weights(loss_mask: torch.Tensor, depths: int) -> list[float]:
    """Trained elements per depth of a row alone under COD sampling at ratio 1, a loop: depth 0 every anchor a of
    0..S-3 whose label position a + 1 is trained, depth d >= 1 the anchors with a + d <= S - 3 whose label positions
    a + 2 .. a + 1 + d are all trained (each depth drawn from the one before)."""
    n = loss_mask.shape[1] - 2
    trained = loss_mask[0].tolist()
    counts = [sum(trained[a + 1] for a in range(n))]
    for d in range(1, depths):
        counts.append(sum(all(trained[a + 1 + j] for j in range(1, d + 1)) for a in range(n - d)))
    return [float(c) for c in counts]


@pytest.mark.parametrize("num_layers", [1, 2])
def test_peagle_loss_of_a_packed_row_is_each_documents_own(tmp_path, num_layers):
    """COD sampling at ratio 1 (every rollout: no draw): the element-mean loss and every depth's loss_d of the packed
    row times its trained elements equal the sums over its documents alone."""
    from trainer.methods.peagle.objective import PEagle

    K = 3
    saved_llama(tmp_path / "target", tied=False)
    objective = PEagle(str(tmp_path / "target"), draft_vocab_size=32, target_layers=[0, 1, 2], mask_token_id=63,
                       num_depths=K, cod_ratio=1.0, cod_min_ratio=1.0, num_layers=num_layers)  # fmt: skip
    rows = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    objective.build_vocab_map(rows.numpy(), (rows > 4).numpy())
    torch.manual_seed(2)
    for p in objective.drafter.parameters():
        nn.init.normal_(p, std=0.3)  # drafts that depend on their inputs, the placeholders included
    batch = packed([8, 6, 9], vocab=63, seed=4, untrained=(18,))
    docs = alone(batch)
    with torch.no_grad():
        loss, metrics = objective.compute_loss(batch)
        own = [objective.compute_loss(doc) for doc in docs]
        crossing, _ = objective.compute_loss(without_documents(batch))
    weights = [peagle_weights(doc["loss_mask"], K) for doc in docs]
    total = sum(sum(w) for w in weights)
    want = sum(float(o[0]) * sum(w) for o, w in zip(own, weights, strict=True))
    assert float(loss) * total == pytest.approx(want, rel=1e-5)
    for d in range(K):
        want = sum(float(o[1][f"loss_{d}"]) * w[d] for o, w in zip(own, weights, strict=True))
        assert float(metrics[f"loss_{d}"]) * sum(w[d] for w in weights) == pytest.approx(want, rel=1e-5)
    assert float(crossing) != pytest.approx(float(loss), rel=1e-4)
    with torch.no_grad():
        assert_one_document_changes_nothing(objective, batch)


def test_peagle_mask_keeps_elements_within_their_anchors_document():
    """peagle_mask with documents, against its definition by a loop; the flex mod is the same mask."""
    from trainer.methods.eagle3.module import masked_attention
    from trainer.methods.peagle.module import peagle_mask, peagle_mask_mod
    from trainer.models.block_attention import flex_attention

    anchor = torch.tensor([[0, 1, 2, 3, 4, 5, 1, 2, 4, 1]])
    depth = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 2]])
    valid = torch.ones(1, 10, dtype=torch.bool)
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])  # [1, S]
    for window in (None, 2):
        allowed = peagle_mask(anchor, depth, valid, window, documents)[0, 0]
        for q in range(10):
            for k in range(10):
                aq, ak, dq, dk = (int(x) for x in (anchor[0, q], anchor[0, k], depth[0, q], depth[0, k]))
                rule = (dk == 0 and ak <= aq) or (ak == aq and dk <= dq)
                rule = rule and (window is None or (aq + dq) - (ak + dk) < window)
                rule = rule and bool(documents[0, aq] == documents[0, ak])
                assert bool(allowed[q, k]) == (rule or q == k), (q, k)
        torch.manual_seed(0)
        q, k, v = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
        flex = flex_attention(q, k, v, peagle_mask_mod(anchor, depth, valid, window, documents), 1)
        dense = masked_attention(q, k, v, peagle_mask(anchor, depth, valid, window, documents))
        torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------------- DFlash


def dflash_weight(objective, loss_mask: torch.Tensor) -> float:
    """The summed slot weights of a row alone, a loop: every anchor a with tokens a and a + 1 trained (the objective
    takes them all: max_anchors above their count), slot k of its block weighted decay[k - 1] (D-PACE: 1) where token
    a + k is in the row and trained."""
    b = objective.drafter.config.block_size
    trained = [False] + loss_mask[0, :-1].tolist()  # token t is a trained label
    S = len(trained)
    total = 0.0
    for a in range(S - 1):
        if not (trained[a] and trained[a + 1]):
            continue
        for k in range(1, b):
            if a + k < S and trained[a + k]:
                total += 1.0 if objective.position_weights == "dpace" else float(objective.decay[k - 1])
    return total


@pytest.mark.parametrize(("labels", "weights"), [("data", "exp"), ("soft", "exp"), ("argmax", "dpace")])
def test_dflash_loss_of_a_packed_row_is_each_documents_own(tmp_path, labels, weights):
    """Every anchor taken (max_anchors above their count, so none is drawn): the packed row's loss (the weighted mean
    of its slots' losses) times its slots' summed weights equals the sum of each document's own; the slots whose token
    lies in the next document are not trained, the block's context is its anchor's document."""
    from trainer.methods.dflash.objective import DFlash

    save_target(tmp_path / "target")
    objective = DFlash(str(tmp_path / "target"), num_draft_layers=2, target_layers=[1, 3], block_size=4,
                       mask_token_id=V - 1, max_anchors=64, labels=labels, loss_chunk_size=7,
                       position_weights=weights)  # fmt: skip
    for p in objective.drafter.parameters():
        nn.init.normal_(p, std=0.3)
    with torch.no_grad():  # a peaked target head: slot losses far from uniform, so that crossing documents shows
        objective.target.model.get_output_embeddings().weight.mul_(30.0)
    batch = packed([6, 9, 5], vocab=V, seed=2, untrained=(10,))
    docs = alone(batch)
    with torch.no_grad():
        loss, metrics = objective.compute_loss(batch)
        own = [objective.compute_loss(doc)[0] for doc in docs]
        crossing, _ = objective.compute_loss(without_documents(batch))
    w = [dflash_weight(objective, doc["loss_mask"]) for doc in docs]
    want = sum(float(o) * x for o, x in zip(own, w, strict=True))
    assert float(loss) * sum(w) == pytest.approx(want, rel=1e-5)
    assert float(crossing) != pytest.approx(float(loss), rel=1e-4)
    with torch.no_grad():
        assert_one_document_changes_nothing(objective, batch)


def children():
    """DFlash's children with the small options of their own tests."""
    from tests.unit.test_dflash2 import SMALL
    from tests.unit.test_domino import HEAD
    from tests.unit.test_dspark import HEADS
    from trainer.methods.dflash2.objective import DFlash2
    from trainer.methods.domino.objective import Domino
    from trainer.methods.dspark.objective import DSpark
    from trainer.methods.xpress.objective import XPress

    xpress = {"xpress_rank": 6, "consistency_passes": 2, "base_anchor_full_weight": True}
    return [
        (DSpark, {**HEADS, "confidence_head_alpha": 0.7}),
        (DFlash2, {**SMALL, "selector_loss_alpha": 0.7}),
        (XPress, xpress),
        (Domino, HEAD),
    ]


@pytest.mark.parametrize("index", range(4), ids=["dspark", "dflash2", "xpress", "domino"])
def test_dflash_children_train_each_document_as_alone(tmp_path, index):
    """Blocks anchored in one document of a packed row (the anchors fixed): the child's loss and every metric equal
    that document's alone with the same anchors, for the first and the last document: their refiners read no token
    past the anchor's document."""
    cls, options = children()[index]
    save_target(tmp_path / "target")
    objective = cls(str(tmp_path / "target"), num_draft_layers=1, target_layers=[1, 3], block_size=4,
                    mask_token_id=V - 1, max_anchors=8, labels="data", loss_chunk_size=4, **options)  # fmt: skip
    torch.manual_seed(3)
    for p in objective.drafter.parameters():
        nn.init.normal_(p, std=0.3)
    batch = packed([7, 8], vocab=V, seed=5)
    first, last = alone(batch)

    def loss_with(anchors: list[int], row: dict[str, torch.Tensor]):
        fixed = torch.tensor([anchors]), torch.ones(1, len(anchors), dtype=torch.bool)  # [1, N] each
        objective.anchors = lambda trained, stage: fixed
        with torch.no_grad():
            return objective.compute_loss(row)

    for anchors, doc, start in (([1, 3, 5], first, 0), ([8, 10, 12], last, 7)):
        loss, metrics = loss_with(anchors, batch)
        want, want_metrics = loss_with([a - start for a in anchors], doc)
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        for key in want_metrics:
            torch.testing.assert_close(metrics[key], want_metrics[key], rtol=1e-5, atol=1e-6, msg=key)


# ------------------------------------------------------------------------------------------------------ real fits


@pytest.mark.parametrize(
    ("recipe", "model"),
    [
        ("quickstart/eagle3.yaml", {"draft_vocab_size": 256, "ttt_steps": 2, "target_layers": [0, 1, 2]}),
        ("quickstart/dflash.yaml", {"num_draft_layers": 1, "block_size": 4, "mask_token_id": 2, "max_anchors": 8}),
    ],
)
def test_a_fit_with_document_masking_runs(tiny_corpus, tmp_path, recipe, model):
    """``draftsmith fit`` two steps on a random target with data.document_masking: batches carry document_ids, the
    objective takes them, the loss is finite."""
    target = save_random_target(tmp_path / "target", tiny_corpus.tokenizer_dir)
    run = tmp_path / "run"
    override = merge(
        trainer_overrides(run, max_steps=2, every_n=2),
        data_overrides(tiny_corpus, document_masking=True),
        {"model": {"init_args": {"target": str(target), **model}}},
    )
    cli = fit(recipe, override, run)
    assert cli.trainer.global_step == 2 and cli.datamodule.document_masking
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
