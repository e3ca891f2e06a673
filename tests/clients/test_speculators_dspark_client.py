"""DSpark (a DFlash drafter with a Markov logit-bias head and a confidence head) between draftsmith and speculators 0.9:
our ``dspark`` export loaded by speculators' ``SpeculatorModel.from_pretrained``, and a ``DSparkDraftModel`` built by
speculators' own trainer code read by us, each giving the same Markov-biased logits and confidence logits as
speculators' own ``DSparkDraftModel.forward``.

Opt-in (``DRAFTSMITH_TEST_CLIENTS=1``): speculators runs in its own virtualenv (tests/clients/venvs.py).
tests/clients/speculators_dflash_forward.py ``forward`` runs ``DSparkDraftModel.forward`` on fixed anchors and
captures what it hands its loss (``compute_metrics``); ``make --dspark R`` builds the drafter as ``speculators train``
does. Our side drafts each block alone against the cached context, as the proposer does, and applies the heads with
the token before each slot's (speculators' teacher forcing, ``sample_from_anchor`` false).
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
from trainer.methods.dspark import kind as dspark_kind
from trainer.methods.dspark.module import DSparkConfig, DSparkDrafter
from trainer.training.registry import load_drafter

RANK = 16

pytestmark = opt_in("speculators")


@pytest.fixture(scope="session")
def client_python() -> Path:
    return venv_python("speculators", SPECULATORS)


def ours(drafter: DSparkDrafter, model, ids: torch.Tensor, hidden) -> tuple[torch.Tensor, torch.Tensor]:
    """Our logits [N * b, V] and confidence logits [N * b] of every anchored block, slot 0 included."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    logits, confidence = [], []
    for a in ANCHORS:
        with torch.no_grad():
            past = drafter.context_kv(drafter.context([hidden[i][:, :a] for i in AUX]), torch.arange(a)[None])
            block = F.embedding(drafter.block_ids(ids[:, a : a + 1]), embedding)  # [1, b, H]
            out = drafter.draft(block, torch.arange(a, a + BLOCK)[None], past)[0]  # [b, H]
            prev = torch.cat([ids[0, a : a + 1], ids[0, a : a + BLOCK - 1]])  # [b]: the token before each slot's
            biased, conf = drafter.apply_heads(out, out @ head.t(), prev)
        logits.append(biased)
        confidence.append(conf)
    return torch.cat(logits), torch.cat(confidence)


def compare(client_python, root: Path, export: Path, drafter, model, name: str) -> None:
    path, ids, hidden = write_features(root, model, f"dspark_features_{name}")
    out = root / f"dspark_theirs_{name}.safetensors"
    report = run(client_python, "forward", str(export), str(path), str(out), "--attn", "sdpa")
    assert report["markov"] == "vanilla" and report["confidence_head"] and report["sample_from_anchor"] is False
    theirs = load_file(str(out))
    logits, confidence = ours(drafter.eval(), model, ids, hidden)
    torch.testing.assert_close(logits, theirs["logits"][0], rtol=1e-4, atol=1e-4, msg=lambda m: f"{report}: {m}")
    torch.testing.assert_close(confidence, theirs["confidence"][0], rtol=1e-4, atol=1e-4)


def test_our_dspark_export_gives_speculators_our_logits_and_confidences(client_python, target):  # noqa: F811
    root, model = target
    config = DFlashConfig.from_target(model.config, 2, AUX, block_size=BLOCK, mask_token_id=V - 1)
    config = DSparkConfig(
        **{**config.to_dict(), "markov_rank": RANK, "enable_confidence_head": True, "confidence_head_with_markov": True}
    )
    torch.manual_seed(0)
    drafter = DSparkDrafter(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_((1.0 if p.ndim == 1 and p.numel() > 1 else 0.0) + 0.1 * torch.randn(p.shape))
    record = dspark_kind.make_record(config, str(root / "target"), ["LlamaForCausalLM"])
    export = dspark_kind.DSPARK.write(drafter, record, root / "ours_dspark")
    compare(client_python, root, export, drafter, model, "ours")


def test_a_dspark_drafter_speculators_saved_drafts_what_speculators_drafts(client_python, target):  # noqa: F811
    root, model = target
    export = root / "their_dspark"
    run(client_python, "make", str(root / "target"), str(export), "--block-size", str(BLOCK), "--aux",
        ",".join(str(i) for i in AUX), "--mask", str(V - 1), "--dspark", str(RANK))  # fmt: skip
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["markov_rank"] == RANK
    drafter, record = load_drafter(str(export))
    assert record.kind == "dspark" and drafter.config.markov_rank == RANK and drafter.config.enable_confidence_head
    compare(client_python, root, export, drafter, model, "theirs")
