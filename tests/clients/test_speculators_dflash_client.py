"""A DFlash drafter written by speculators' own trainer code and ``save_pretrained``, read by draftsmith: the same
block outputs and logits as speculators' own forward, for its default sliding-window layers (causal inside the block)
and for the other layouts its trainer writes.

Opt-in (``DRAFTSMITH_TEST_CLIENTS=1``): speculators 0.9.0 runs in its own virtualenv (tests/clients/venvs.py, shared
with test_speculators_client.py). tests/clients/speculators_dflash_forward.py ``make`` builds the drafter over a tiny
local Llama target as ``speculators train`` does (create_transformer_layer_config, from_training_args) and saves it;
``forward`` runs speculators' ``_backbone_forward`` on fixed anchors. Our side loads the folder with ``load_drafter``
and drafts each block alone against the cached context, as the proposer does.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from tests.clients.venvs import client_python as venv_python
from tests.clients.venvs import opt_in
from trainer.training.registry import load_drafter

SCRIPT = Path(__file__).with_name("speculators_dflash_forward.py")
SPECULATORS = "speculators==0.9.0"
V, T, BLOCK = 256, 40, 8
AUX = (1, 3)  # HF hidden_states indices, as speculators counts them
ANCHORS = (3, 17, 30)

pytestmark = opt_in("speculators")


def write_features(root: Path, model, name: str) -> tuple[Path, torch.Tensor, tuple]:
    """The features file speculators' forward reads (the target's hidden states at AUX, the tokens, the anchors) for
    random tokens, and those tokens and hidden states."""
    ids = torch.randint(0, V - 1, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    path = root / f"{name}.safetensors"
    tensors = {"hidden_states": torch.cat([hidden[i] for i in AUX], dim=-1), "input_ids": ids}
    save_file({**{k: v.contiguous() for k, v in tensors.items()}, "anchors": torch.tensor(ANCHORS)}, str(path))
    return path, ids, hidden


@pytest.fixture(scope="session")
def client_python() -> Path:
    """The speculators client's python (tests/clients/venvs.py)."""
    return venv_python("speculators", SPECULATORS)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[Path, LlamaForCausalLM]:
    root = tmp_path_factory.mktemp("speculators_dflash")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(str(root / "target"))
    return root, model


def run(python: Path, *args: str) -> dict:
    done = subprocess.run([str(python), str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    lines = done.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    assert report is not None and done.returncode == 0, f"rc {done.returncode}:\n{done.stderr[-4000:]}\n{report}"
    return report


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("default", []),  # speculators train's defaults: sliding_attention layers, window 2048, causal blocks
        ("window", ["--sliding-window", "5"]),  # a window shorter than the context
        ("mixed", ["--sliding-window", "5", "--full-attention-indices", "1", "--non-causal"]),
    ],
)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_folder_speculators_saved_drafts_what_speculators_drafts(client_python, target, name, make, attn):
    root, model = target
    export = root / f"export_{name}"
    if not export.is_dir():
        aux = ",".join(str(i) for i in AUX)
        run(client_python, "make", str(root / "target"), str(export), "--block-size", str(BLOCK), "--aux", aux,
            "--mask", str(V - 1), *make)  # fmt: skip
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["speculators_model_type"] == "dflash"

    drafter, record = load_drafter(str(export))
    assert record.kind == "dflash" and record.target_layers == list(AUX) and record.draft_tokens == BLOCK - 1
    if name == "default":
        assert drafter.config.layer_types == ("sliding_attention",) * 2 and drafter.config.sliding_window == 2048
        assert drafter.config.sliding_window_non_causal is False

    features, ids, hidden = write_features(root, model, f"features_{name}")
    out = root / f"theirs_{name}_{attn}.safetensors"
    report = run(client_python, "forward", str(export), str(features), str(out), "--attn", attn)
    theirs = load_file(str(out))

    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    drafter.eval()
    for j, a in enumerate(ANCHORS):
        with torch.no_grad():
            past = drafter.context_kv(drafter.context([hidden[i][:, :a] for i in AUX]), torch.arange(a)[None])
            block = F.embedding(drafter.block_ids(ids[:, a : a + 1]), embedding)  # [1, b, H]
            ours = drafter.draft(block, torch.arange(a, a + BLOCK)[None], past)  # [1, b, H]
        part = slice(j * BLOCK, (j + 1) * BLOCK)
        msg = f"{name}, {attn}, anchor {a} ({report})"
        torch.testing.assert_close(
            ours[0], theirs["hidden"][0, part], rtol=1e-5, atol=1e-5, msg=lambda m, s=msg: f"{s}: {m}"
        )
        torch.testing.assert_close(
            ours[0] @ head.t(), theirs["logits"][0, part], rtol=1e-4, atol=1e-4, msg=lambda m, s=msg: f"{s}: {m}"
        )
