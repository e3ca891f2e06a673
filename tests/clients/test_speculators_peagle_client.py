"""The ``peagle-speculators`` export read by the speculators library itself: same logits as ours for the same
elements (opt-in, ``DRAFTSMITH_TEST_CLIENTS=1``; the speculators 0.9 virtualenv of test_speculators_client.py).

A random P-EAGLE drafter over a tiny local Llama target is exported with ``save_peagle``;
tests/clients/speculators_peagle_forward.py loads it with ``SpeculatorModel.from_pretrained`` (refusing it when a
tensor the forward uses, ``embed_tokens.weight`` and ``mask_hidden`` included, did not come from the file) and runs
``PEagleDraftModel.forward`` on the elements our COD sampling drew; our side is ``PEagleDrafter.parallel``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from tests.clients.venvs import client_python as venv_python
from tests.clients.venvs import opt_in
from trainer.methods.eagle3.module import Eagle3Config
from trainer.methods.eagle3.vocab_map import build_vocab_map
from trainer.methods.peagle.export import save_peagle
from trainer.methods.peagle.module import PEagleConfig, PEagleDrafter
from trainer.methods.peagle.objective import cod_sample

SCRIPT = Path(__file__).with_name("speculators_peagle_forward.py")
SPECULATORS = "speculators==0.9.0"
S, K = 24, 4  # elements of the row, depths
AUX = (1, 2, 3)

pytestmark = opt_in("speculators")

FLAGS = {
    "plain": {},
    "fc_norm": {"fc_norm": True},
    "norm_before_fc": {"norm_before_fc": True, "norm_before_residual": True},
}
LAYERS = {"plain": 1, "fc_norm": 3, "norm_before_fc": 2}  # decoder layers: layers.0 and layers.1.. after it


@pytest.fixture(scope="session")
def client_python() -> Path:
    return venv_python("speculators", SPECULATORS)


@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("attn", ["simple_flex_attention", "eager"])
def test_speculators_reads_our_peagle_logits(client_python, tmp_path, flags, attn):
    torch.manual_seed(0)
    target_config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    target = LlamaForCausalLM(target_config).eval()
    target.save_pretrained(str(tmp_path / "target"))
    base = Eagle3Config.from_target(target_config, draft_vocab_size=96, aux_layers=AUX, **FLAGS[flags])
    drafter = PEagleDrafter(PEagleConfig(**base.to_dict(), mask_token_id=255, num_layers=LAYERS[flags]))
    for p in drafter.parameters():
        nn.init.normal_(p, std=0.3)
    drafter.set_vocab_map(*build_vocab_map(torch.randint(0, 100, (256,)), 96))
    drafter.eval()
    export = save_peagle(drafter, str(tmp_path / "export"), verifier=str(tmp_path / "target"), speculative_tokens=K,
                         verifier_architectures=["LlamaForCausalLM"])  # fmt: skip
    ids = torch.randint(0, 250, (1, S + 1))
    trained = torch.ones(S + 1, dtype=torch.bool)
    parts = cod_sample(trained[1:], K, 0.7, 0.2, torch.Generator().manual_seed(1))
    anchor, depth = torch.cat([a for a, _ in parts]), torch.cat([d for _, d in parts])  # [N] each
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([hidden[i][:, :-1] for i in AUX], -1)  # [1, S, 3 Ht]
        n = len(parts[0][0])  # the depth-0 elements, anchors 0..n-1, first
        fused = drafter.fuse(list(aux[:, :n].split(64, -1)))  # [1, n, H]
        ours = drafter.parallel(drafter.embed_tokens(ids[:, 1 : n + 1]), fused, anchor[None], depth[None],
                                torch.ones(1, len(anchor), dtype=torch.bool))  # fmt: skip
    features = tmp_path / "features.safetensors"
    save_file({"hidden_states": aux.contiguous(), "input_ids": ids[:, 1:].contiguous(), "anchor": anchor,
               "depth": depth}, str(features))  # fmt: skip
    out = tmp_path / "theirs.safetensors"
    done = subprocess.run([str(client_python), str(SCRIPT), str(export), str(features), str(out), "--attn", attn],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    lines = done.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    assert report is not None, f"speculators_peagle_forward.py failed (rc {done.returncode}):\n{done.stderr[-4000:]}"
    assert report["model_class"] == "PEagleDraftModel" and report["mask_token_id"] == 255 and report["steps"] == K
    assert report["layers"] == LAYERS[flags]
    assert not report["missing"] and not report["differ_from_file"] and not report["nan"] and not report["unused"]
    assert done.returncode == 0, done.stderr[-4000:]
    for flag, on in FLAGS[flags].items():
        assert report["config_flags"][flag] is on
    assert int((depth == K - 1).sum()) > 0
    torch.testing.assert_close(load_file(str(out))["logits"], ours, rtol=1e-5, atol=1e-5)
