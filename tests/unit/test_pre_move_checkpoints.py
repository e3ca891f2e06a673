"""Checkpoints written before the move to one package per method load, and draft exactly as they did.

tests/fixtures/pre_move/README.md says how the checkpoints and ``expected.json`` were made (commit 478fa74).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from trainer.decoding.generate import speculative_generate
from trainer.decoding.options import ProposerOptions
from trainer.training.registry import get_kind, load_drafter

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pre_move"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
KINDS = {"kd": "hf_causal_lm", "eagle3": "eagle3", "dflash": "dflash", "medusa1": "medusa"}


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(FIXTURES / "tiny_target").eval()


@pytest.mark.parametrize("name", sorted(KINDS))
def test_a_checkpoint_written_before_the_move_drafts_as_it_did(name, target, one_thread) -> None:
    module, record = load_drafter(str(FIXTURES / f"{name}.ckpt"))
    assert record.kind == KINDS[name]
    state = torch.load(FIXTURES / f"{name}.ckpt", weights_only=True)["state_dict"]
    (prefix,) = record.components.values()
    loaded = module.state_dict()
    for key, value in state.items():  # every trained tensor reached the rebuilt module unchanged
        assert torch.equal(loaded[key.removeprefix(prefix)], value), key
    proposer = get_kind(record.kind, name).proposer(module, record, target, ProposerOptions())
    drafts: list[list[int]] = []
    propose = proposer.propose

    def recording(ctx):
        tree = propose(ctx)
        drafts.append(tree.tokens.tolist())
        return tree

    proposer.propose = recording
    for prompt, expected in zip(EXPECTED["prompts"], EXPECTED["drafters"][name], strict=True):
        drafts.clear()
        proposer.reset()
        result = speculative_generate(target, torch.tensor(prompt), proposer, EXPECTED["k"], EXPECTED["max_new_tokens"])
        assert drafts == expected["drafts"]
        assert [r.accepted for r in result.rounds] == expected["accepted"]
        assert result.tokens == expected["tokens"]
