"""DFlash2 (a DFlash drafter with dynamic convolutions around its sublayers and a path selector) between draftsmith and
speculators 0.9: our ``dflash2`` export loaded by speculators' ``SpeculatorModel.from_pretrained`` (a
``DFlash2DraftModel``), and a ``DFlash2DraftModel`` built by speculators' own trainer code read by us, each giving the
same unary logits, selector candidates and rescored candidate logits as speculators' own ``DFlash2DraftModel.forward``.

Opt-in (``DRAFTSMITH_TEST_CLIENTS=1``): speculators runs in its own virtualenv (tests/clients/venvs.py).
tests/clients/speculators_dflash_forward.py ``forward`` runs ``DFlash2DraftModel.forward`` on fixed anchors and
captures what it hands its loss (``compute_metrics``), after checking that every tensor of the file is used and none
is NaN; ``make --dflash2 R`` builds the drafter as ``speculators train`` does (sliding-window layers, non-causal
blocks: DFlash2's default). Our side drafts each block alone against the cached context, as the proposer does, and
rescores the candidates with the token before each slot's (speculators' teacher forcing, ``sample_from_anchor``
false).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.clients.test_speculators_dflash_client import ANCHORS, AUX, BLOCK, SPECULATORS, V, run, write_features
from tests.clients.test_speculators_dflash_client import target as target  # noqa: F401 (the module's fixture)
from tests.clients.venvs import client_python as venv_python
from tests.clients.venvs import opt_in
from trainer.methods.dflash.module import DFlashConfig
from trainer.methods.dflash2 import kind as dflash2_kind
from trainer.methods.dflash2.module import DFlash2Config, DFlash2Drafter
from trainer.methods.dflash2.selector import training_candidates
from trainer.training.registry import load_drafter

RANK = 16

pytestmark = opt_in("speculators")


@pytest.fixture(scope="session")
def client_python() -> Path:
    return venv_python("speculators", SPECULATORS)


def ours(drafter: DFlash2Drafter, model, ids: torch.Tensor, hidden, candidates: torch.Tensor):
    """Our unary logits [N * b, V] of every anchored block (slot 0 included), our candidates [N * b, K] (the unary
    top-k, token 0 injected last where missing: speculators' targets of the zero hidden state) and the rescored
    logits [N * b, K] of speculators' candidates ``candidates``."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    logits, outs, prevs = [], [], []
    for a in ANCHORS:
        with torch.no_grad():
            past = drafter.context_kv(drafter.context([hidden[i][:, :a] for i in AUX]), torch.arange(a)[None])
            block = F.embedding(drafter.block_ids(ids[:, a : a + 1]), embedding)  # [1, b, H]
            out = drafter.draft(block, torch.arange(a, a + BLOCK)[None], past)[0]  # [b, H]
        outs.append(out)
        logits.append(out @ head.t())
        prevs.append(torch.cat([ids[0, a : a + 1], ids[0, a : a + BLOCK - 1]]))  # [b]: the token before each slot's
    logits, out, prev = torch.cat(logits), torch.cat(outs), torch.cat(prevs)
    selector = drafter.candidate_selector
    with torch.no_grad():
        mine = training_candidates(selector.candidates(logits), torch.zeros_like(prev))[0]
        scores = selector.scores(logits, out, prev, candidates)
    return logits, mine, scores


def compare(client_python, root: Path, export: Path, drafter: DFlash2Drafter, model, name: str) -> dict:
    path, ids, hidden = write_features(root, model, f"dflash2_features_{name}")
    out = root / f"dflash2_theirs_{name}.safetensors"
    report = run(client_python, "forward", str(export), str(path), str(out), "--attn", "sdpa")
    assert report["sample_from_anchor"] is False
    assert report["dflash2"] == {k: getattr(drafter.config, k) for k in report["dflash2"]}
    theirs = load_file(str(out))
    logits, candidates, scores = ours(drafter.eval(), model, ids, hidden, theirs["candidates"][0])
    torch.testing.assert_close(logits, theirs["logits"][0], rtol=1e-4, atol=1e-4, msg=lambda m: f"{report}: {m}")
    assert torch.equal(candidates, theirs["candidates"][0])
    torch.testing.assert_close(scores, theirs["candidate_logits"][0], rtol=1e-4, atol=1e-4)
    return report


def test_our_dflash2_export_gives_speculators_our_logits_and_candidates(client_python, target):  # noqa: F811
    root, model = target
    config = DFlashConfig.from_target(model.config, 2, AUX, block_size=BLOCK, mask_token_id=V - 1)
    config = DFlash2Config(**{**config.to_dict(), "selector_rank": RANK})  # speculators' convolutions and top-k
    torch.manual_seed(0)
    drafter = DFlash2Drafter(config)
    with torch.no_grad():  # every weight drawn, the convolutions away from the identity
        for p in drafter.parameters():
            p.copy_((1.0 if p.ndim == 1 and p.numel() > 1 else 0.0) + 0.1 * torch.randn(p.shape))
    record = dflash2_kind.make_record(config, str(root / "target"), ["LlamaForCausalLM"])
    export = dflash2_kind.DFLASH2.write(drafter, record, root / "ours_dflash2")
    report = compare(client_python, root, export, drafter, model, "ours")
    assert report["sliding_window_indices"] == []  # our layers are full-attention ones


def test_a_dflash2_drafter_speculators_saved_drafts_what_speculators_drafts(client_python, target):  # noqa: F811
    root, model = target
    export = root / "their_dflash2"
    run(client_python, "make", str(root / "target"), str(export), "--block-size", str(BLOCK), "--aux",
        ",".join(str(i) for i in AUX), "--mask", str(V - 1), "--dflash2", str(RANK))  # fmt: skip
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["selector_rank"] == RANK
    drafter, record = load_drafter(str(export))
    assert record.kind == "dflash2" and isinstance(drafter, DFlash2Drafter)
    assert drafter.config.sliding_window_non_causal and not drafter.config.all_full  # speculators' default layers
    report = compare(client_python, root, export, drafter, model, "theirs")
    assert report["sliding_window_non_causal"] is True and report["sliding_window_indices"] == [0, 1]
