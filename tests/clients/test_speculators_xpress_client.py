"""XPress (a DFlash drafter with a causal refiner head) between draftsmith and speculators 0.9: our ``xpress`` export
loaded by speculators' ``SpeculatorModel.from_pretrained``, and an ``XPressDraftModel`` built by speculators' own
trainer code read by us, each giving the same refined logits as speculators' own ``XPressDraftModel.forward``: the
teacher-forced pass, its three free-running rounds (each on the previous round's argmax) and the backbone's own logits.

Opt-in (``DRAFTSMITH_TEST_CLIENTS=1``): speculators runs in its own virtualenv (tests/clients/venvs.py).
tests/clients/speculators_dflash_forward.py ``forward`` runs ``XPressDraftModel.forward`` on fixed anchors and
captures what it hands its loss (``compute_metrics``); ``make --xpress R`` builds the drafter as ``speculators train``
does. Our side drafts each block alone against the cached context, as the proposer does, and applies the refiner with
the token before each slot's (speculators' teacher forcing, ``sample_from_anchor`` false: slot 0's the token before
the anchor), then the rounds as the objective unrolls them. speculators 0.9's ``from_pretrained`` leaves the
refiner's ``causal_tril`` (a buffer it does not save) uninitialised; the forward script rebuilds it as speculators'
``__init__`` does before running (``causal_tril_as_loaded`` in its report), so the logits compared are the model's.
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
from trainer.methods.xpress import kind as xpress_kind
from trainer.methods.xpress.module import XPressConfig, XPressDrafter
from trainer.training.registry import load_drafter

RANK, ROUNDS = 16, 3  # ROUNDS: speculators' default consistency_passes

pytestmark = opt_in("speculators")


@pytest.fixture(scope="session")
def client_python() -> Path:
    return venv_python("speculators", SPECULATORS)


def ours(drafter: XPressDrafter, model, ids: torch.Tensor, hidden) -> dict[str, torch.Tensor]:
    """Our teacher-forced refined logits [N * b, V], free-running rounds' [ROUNDS * N * b, V] and base logits
    [N * b, V] of every anchored block, slot 0 included."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    refiner = drafter.refiner_head
    logits, rounds, bases = [], [[] for _ in range(ROUNDS)], []
    for a in ANCHORS:
        with torch.no_grad():
            past = drafter.context_kv(drafter.context([hidden[i][:, :a] for i in AUX]), torch.arange(a)[None])
            block = F.embedding(drafter.block_ids(ids[:, a : a + 1]), embedding)  # [1, b, H]
            out = drafter.draft(block, torch.arange(a, a + BLOCK)[None], past)[0]  # [b, H]
            base = out @ head.t()  # [b, V]
            teacher = torch.cat([ids[0, a - 1 : a], ids[0, a : a + BLOCK - 1]])  # [b]: the token before each slot's
            cache = refiner.hidden_cache(out)
            logits.append(base + refiner.bias(refiner.features(teacher, cache)))
            guess = base.argmax(-1)
            for j in range(ROUNDS):
                guess[0] = ids[0, a]
                refined = base + refiner.bias(refiner.features(torch.cat([teacher[:1], guess[:-1]]), cache))
                rounds[j].append(refined)
                guess = refined.argmax(-1)
            bases.append(base)
    return {"logits": torch.cat(logits), "rounds": torch.cat([torch.cat(r) for r in rounds]), "base": torch.cat(bases)}


def compare(client_python, root: Path, export: Path, drafter, model, name: str) -> None:
    path, ids, hidden = write_features(root, model, f"xpress_features_{name}")
    out = root / f"xpress_theirs_{name}.safetensors"
    report = run(client_python, "forward", str(export), str(path), str(out), "--attn", "sdpa")
    assert report["xpress_rank"] == RANK and report["sample_from_anchor"] is False
    assert not report["unused"] and not report["differ_from_file"] and not report["nan"]  # every tensor used
    theirs = load_file(str(out))
    mine = ours(drafter.eval(), model, ids, hidden)
    assert theirs["rounds"].shape == (ROUNDS, len(ANCHORS) * BLOCK, V)
    for key in ("logits", "rounds", "base"):
        torch.testing.assert_close(mine[key], theirs[key].reshape(mine[key].shape), rtol=1e-4, atol=1e-4,
                                   msg=lambda m, key=key: f"{key} {report}: {m}")  # fmt: skip
    assert not torch.allclose(mine["logits"], mine["base"], atol=1e-2)  # the refiner counts (else the check is void)


def test_our_xpress_export_gives_speculators_our_refined_logits(client_python, target):  # noqa: F811
    root, model = target
    config = DFlashConfig.from_target(model.config, 2, AUX, block_size=BLOCK, mask_token_id=V - 1)
    config = XPressConfig(**{**config.to_dict(), "xpress_rank": RANK, "num_jacobi_passes": 4})
    torch.manual_seed(0)
    drafter = XPressDrafter(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_((1.0 if p.ndim == 1 and p.numel() > 1 else 0.0) + 0.1 * torch.randn(p.shape))  # mix_l too
    record = xpress_kind.make_record(config, str(root / "target"), ["LlamaForCausalLM"])
    export = xpress_kind.XPRESS.write(drafter, record, root / "ours_xpress")
    compare(client_python, root, export, drafter, model, "ours")


def test_an_xpress_drafter_speculators_saved_drafts_what_speculators_drafts(client_python, target):  # noqa: F811
    root, model = target
    export = root / "their_xpress"
    run(client_python, "make", str(root / "target"), str(export), "--block-size", str(BLOCK), "--aux",
        ",".join(str(i) for i in AUX), "--mask", str(V - 1), "--xpress", str(RANK), "--full-attention-indices",
        "0,1")  # fmt: skip
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_model_type"] == "xpress" and config["xpress_rank"] == RANK
    drafter, record = load_drafter(str(export))
    assert record.kind == "xpress" and drafter.config.xpress_rank == RANK and drafter.config.num_jacobi_passes == 6
    compare(client_python, root, export, drafter, model, "theirs")
