"""The speculators export read by the speculators library itself: same draft logits as ours at every TTT step.

Opt-in (``DRAFTSMITH_TEST_CLIENTS=1``): speculators 0.9.0 pins transformers <= 5.19, so it runs in its own virtualenv,
built once under ``.cache/clients/speculators`` (torch==2.13.0 first, so that pip keeps the CPU build; a few minutes)
and reused while its stamp matches the pins. A failed install skips the test with pip's message.

A random drafter over a tiny local Llama target is exported with ``save_speculators`` (the target's folder as the
verifier, which speculators 0.9 reads on every load), and tests/clients/speculators_forward.py loads it with
``SpeculatorModel.from_pretrained``, refuses it when a tensor the forward uses did not come from the file, and runs
``Eagle3DraftModel.forward`` for K TTT steps on the target's features. Our side is ``Eagle3Drafter.unroll`` with the
data tokens fed at steps i > 0 and zeros past the end of the row, which is what speculators feeds.

Each norm flag of EAGLE-3.1 (module.py: norm_before_residual, norm_before_fc, fc_norm, norm_output), alone and
together, is exported and run the same way: speculators builds its ``input_norm`` / ``fc_norm`` modules from the
flags our export writes, reads their weights from the file, and its logits match ours at every TTT step.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from tests.clients.venvs import client_python as venv_python
from tests.clients.venvs import opt_in
from trainer.methods.eagle3 import export as formats
from trainer.methods.eagle3.module import Eagle3Config, Eagle3Drafter
from trainer.methods.eagle3.vocab_map import build_vocab_map

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("speculators_forward.py")
SPECULATORS = "speculators==0.9.0"

B, S, K = 2, 12, 3  # rows, elements per row, TTT steps
AUX = (1, 2, 3)  # distinct ids: speculators rejects repeated layer ids (and default_aux_layers(4) repeats one)

pytestmark = opt_in("speculators")

FLAGS = {
    "plain": {},
    "norm_before_residual": {"norm_before_residual": True},
    "norm_before_fc": {"norm_before_fc": True},
    "fc_norm": {"fc_norm": True},
    "norm_output": {"norm_output": True},
    "eagle3.1": {"norm_before_residual": True, "fc_norm": True, "norm_output": True},
}


@pytest.fixture(scope="session")
def client_python() -> Path:
    """The speculators client's python (tests/clients/venvs.py)."""
    return venv_python("speculators", SPECULATORS)


@pytest.fixture(scope="module", params=list(FLAGS))
def case(request, tmp_path_factory) -> dict:
    """A random drafter (with the param's norm flags) over a tiny Llama target, its speculators export, the features
    file and our logits."""
    flags = FLAGS[request.param]
    root = tmp_path_factory.mktemp("speculators_client")
    torch.manual_seed(0)
    target_config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    target = LlamaForCausalLM(target_config).eval()
    target.save_pretrained(str(root / "target"))  # the verifier: speculators reads its config and weights
    drafter = Eagle3Drafter(Eagle3Config.from_target(target_config, draft_vocab_size=96, aux_layers=AUX, **flags))
    for p in drafter.parameters():  # non-trivial norms too
        nn.init.normal_(p, std=0.3)
    drafter.set_vocab_map(*build_vocab_map(torch.randint(0, 100, (256,)), 96))
    drafter.eval()
    export = formats.save_speculators(
        drafter, str(root / "export"), verifier=str(root / "target"), embedding=target.get_input_embeddings().weight,
        speculative_tokens=K, verifier_architectures=["LlamaForCausalLM"],
    )  # fmt: skip

    ids = torch.randint(0, 256, (B, S + 1))  # tokens 0..S of each row
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        aux = [hidden[i][:, :-1] for i in AUX]  # features of tokens 0..S-1, [B, S, Ht] each
        data = F.pad(ids, (0, K))  # zeros past the row: speculators' teacher forcing pads its shifted ids with 0
        steps = drafter.unroll(target.get_input_embeddings(), drafter.fuse(aux), ids[:, 1:], K, data_tokens=data)
        ours = [logits.clone() for logits in steps]  # K x [B, S, Vd]
    features = root / "features.safetensors"
    save_file(
        {
            "hidden_states": torch.cat(aux, dim=-1).contiguous(),  # [B, S, 3 Ht]
            "input_ids": ids[:, 1:].contiguous(),  # token t + 1 of element t
            "position_ids": torch.arange(S).expand(B, S).contiguous(),  # unroll's positions of step 0
        },
        str(features),
    )
    return {"export": export, "features": features, "ours": ours, "root": root, "flags": flags}


@pytest.mark.parametrize("attn", ["simple_flex_attention", "eager"])
def test_speculators_reads_our_logits(client_python, case, attn):
    out = case["root"] / f"speculators_{attn}.safetensors"
    cmd = [str(client_python), str(SCRIPT), str(case["export"]), str(case["features"]), str(out)]
    # no --steps: the client drafts as many steps as the export's speculative_tokens says (vLLM's default too)
    done = subprocess.run(cmd + ["--attn", attn], capture_output=True, text=True, timeout=600)
    lines = done.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    assert report is not None, f"speculators_forward.py failed (rc {done.returncode}):\n{done.stderr[-4000:]}"
    assert not report["missing"], (
        f"speculators did not load {report['missing']} from the export: it keeps uninitialised memory there "
        "(speculators 0.9 ignores a missing embed_tokens.weight and never falls back to the verifier's)"
    )
    assert not report["differ_from_file"] and not report["nan"] and not report["unused"], report
    assert done.returncode == 0, done.stderr[-4000:]
    assert report["steps"] == K, f"the export's speculative_tokens is {report['steps']}, trained with {K} TTT steps"
    for flag, on in case["flags"].items():
        assert report["config_flags"][flag] is on, f"speculators read {flag}={report['config_flags'][flag]}"
    theirs = load_file(str(out))
    for i, ours in enumerate(case["ours"]):
        # float32 on both sides: observed differences ~1e-6 for logits of magnitude ~3
        torch.testing.assert_close(
            theirs[f"logits.{i}"], ours, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"step {i}: {m}"
        )
