"""The z-lab export read by the DFlash authors' ``dflash`` package itself: the same draft logits as ours for the same
target hidden states and block, and the same drafts in every round of its own decoding loop.

Opt-in (``DRAFTSMITH_TEST_CLIENTS=1``): dflash 0.1.0 pins transformers 5.15 (its ``local`` extra), so it runs in its
own virtualenv, built once under ``.cache/clients/dflash`` (torch==2.13.0 first, so that pip keeps the CPU build) and
reused while its stamp matches the pins. A failed install skips the test with pip's message.

A random drafter over a tiny local Llama target is exported with ``save_zlab``; tests/clients/dflash_forward.py loads
it with ``DFlashDraftModel.from_pretrained``, refuses it when a tensor the forward uses did not come from the file,
picks the target layers itself from all of HF's hidden states (``extract_context_feature``, the package's own
reading of ``target_layer_ids``), and runs its forward on the block; with ``--generate`` it also decodes a prompt with
``dflash_generate`` and the same target, recording each round's draft logits.
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
from trainer.decoding.generate import speculative_generate
from trainer.methods.dflash import export as formats
from trainer.methods.dflash.module import DFlashConfig, DFlashDrafter
from trainer.methods.dflash.proposer import DFlashProposer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("dflash_forward.py")
DFLASH = "dflash[local]==0.1.0"

V, S, BLOCK, MASK = 256, 10, 8, 255
LAYERS = (1, 3)  # HF hidden_states indices: z-lab ids 0 and 2

pytestmark = opt_in("dflash")


@pytest.fixture(scope="session")
def dflash_python() -> Path:
    """The dflash client's python (tests/clients/venvs.py)."""
    return venv_python("dflash", DFLASH)


class Recording(DFlashProposer):
    """The chain proposer, recording each round's block logits."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.rounds: list[torch.Tensor] = []

    def block_logits(self, ctx):
        logits = super().block_logits(ctx)
        self.rounds.append(logits.clone())
        return logits


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    """A random drafter over a tiny Llama target, its z-lab export, the features file and our logits."""
    root = tmp_path_factory.mktemp("dflash_client")
    torch.manual_seed(0)
    target_config = LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    target = LlamaForCausalLM(target_config).eval()
    target.save_pretrained(str(root / "target"))
    drafter = DFlashDrafter(DFlashConfig.from_target(target_config, 2, LAYERS, block_size=BLOCK, mask_token_id=MASK))
    for p in drafter.parameters():  # non-trivial norms too
        nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.1)
    drafter.eval()
    export = formats.save_zlab(drafter, str(root / "export"))

    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    ids = torch.randint(0, V - 1, (2, S + 1))  # the context's tokens, then the anchor
    block_ids = drafter.block_ids(ids[:, S : S + 1])  # [2, b]
    with torch.no_grad():
        hidden = target(ids[:, :S], output_hidden_states=True).hidden_states  # L + 1 x [2, S, H]
        context = drafter.context([hidden[i] for i in LAYERS])
        past = drafter.context_kv(context, torch.arange(S).expand(2, S))
        out = drafter.draft(F.embedding(block_ids, embedding), torch.arange(S, S + BLOCK).expand(2, BLOCK), past)
        ours = out[:, 1:] @ head.t()  # [2, b - 1, V]
    prompt = torch.randint(0, V - 1, (12,))
    features = root / "features.safetensors"
    tensors = {f"hidden_states.{i}": h.contiguous() for i, h in enumerate(hidden)}
    tensors.update(block_ids=block_ids, embedding=embedding.detach(), lm_head=head.detach(), prompt=prompt)
    save_file(tensors, str(features))
    return {
        "export": export, "features": features, "ours": ours, "root": root, "target": target, "drafter": drafter,
        "prompt": prompt,
    }  # fmt: skip


def run_client(python: Path, case: dict, name: str, *extra: str) -> tuple[dict, dict]:
    out = case["root"] / f"{name}.safetensors"
    cmd = [str(python), str(SCRIPT), str(case["export"]), str(case["features"]), str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = done.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    assert report is not None, f"dflash_forward.py failed (rc {done.returncode}):\n{done.stderr[-4000:]}"
    assert not report["missing"] and not report["differ_from_file"] and not report["nan"], report
    assert not report["unused"], f"the package ignores {report['unused']} of our export"
    assert done.returncode == 0, done.stderr[-4000:]
    return report, load_file(str(out))


def test_the_dflash_package_reads_our_logits(dflash_python, case):
    report, theirs = run_client(dflash_python, case, "forward")
    # the package's reading of the export: its layer ids pick HF hidden_states[id + 1], our target layers
    assert report["target_layer_ids"] == [i - 1 for i in LAYERS]
    assert report["block_size"] == BLOCK and report["mask_token_id"] == MASK
    # float32 on both sides
    torch.testing.assert_close(theirs["logits"], case["ours"], rtol=1e-5, atol=1e-5)


def test_the_dflash_package_drafts_what_our_proposer_drafts(dflash_python, case):
    """Its own decoding loop (dflash_generate, greedy, the same target) drafts in every full-block round what our
    proposer drafts in the engine, and both outputs are the target's greedy output."""
    new_tokens = 24
    report, theirs = run_client(dflash_python, case, "generate", "--generate", str(case["root"] / "target"),
                                "--max-new-tokens", str(new_tokens))  # fmt: skip
    target, drafter, prompt = case["target"], case["drafter"], case["prompt"]
    proposer = Recording(drafter, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    result = speculative_generate(target, prompt, proposer, BLOCK - 1, new_tokens)
    assert theirs["output"][prompt.numel() :].tolist() == result.tokens
    full = [theirs[f"round.{r}"] for r in range(report["rounds"]) if theirs[f"round.{r}"].shape[0] == BLOCK - 1]
    assert len(full) >= 3
    for r, logits in enumerate(full):  # the package shrinks the last blocks to the output budget; we draft whole ones
        torch.testing.assert_close(
            logits, proposer.rounds[r], rtol=1e-4, atol=1e-4, msg=lambda m, r=r: f"round {r}: {m}"
        )
