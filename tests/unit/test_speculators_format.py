"""The speculators format's block (trainer/export/speculators.py) is written and read once: every speculators-format
export (EAGLE-3, P-EAGLE, DFlash, DSpark) opens its config.json with the same three keys and closes it with the dtype,
its kind reads the verifier and drafts per round back through the one reader, and no method writes or reads the
block itself."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from tests.unit.test_dflash_drafter import small_drafter as dflash_drafter
from tests.unit.test_dspark import setup as dspark_setup
from tests.unit.test_eagle3_drafter import small_drafter as eagle3_drafter
from trainer.export import speculators
from trainer.interface.errors import ModelFolderError
from trainer.methods.peagle.module import PEagleConfig, PEagleDrafter
from trainer.training.registry import DrafterRecord, get_kind, load_drafter, recognise

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURES = ["LlamaForCausalLM"]


@pytest.fixture(scope="module")
def verifier(tmp_path_factory) -> str:
    """A saved target of the EAGLE-3 drafters' vocabulary and width (EAGLE-3's writer reads its embedding)."""
    folder = tmp_path_factory.mktemp("target")
    config = LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, architectures=ARCHITECTURES,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def eagle3():
    drafter, _ = eagle3_drafter(1, target_hidden=16)
    return drafter, 5


def peagle():
    base, _ = eagle3_drafter(1, target_hidden=16)
    torch.manual_seed(0)
    drafter = PEagleDrafter(PEagleConfig(**base.config.to_dict(), mask_token_id=base.config.vocab_size - 1))
    for p in drafter.parameters():
        nn.init.normal_(p, std=0.3)
    drafter.load_state_dict({**drafter.state_dict(), "d2t": base.d2t, "t2d": base.t2d})
    return drafter.double(), 4


def dflash():
    drafter = dflash_drafter(0)
    return drafter, drafter.config.block_size - 1


def dspark():
    _, drafter = dspark_setup(2)
    return drafter.float(), drafter.config.block_size - 1


# kind, its speculators format, the speculators_model_type and architectures it writes, a drafter and its drafts
EXPORTS = [
    ("eagle3", "eagle3-speculators", "eagle3", ["Eagle3Speculator"], eagle3),
    ("peagle", "peagle-speculators", "peagle", ["PEagleSpeculator"], peagle),
    ("dflash", "dflash-speculators", "dflash", ["DFlashSpeculator"], dflash),
    ("dspark", "dspark", "dspark", ["DSparkSpeculator"], dspark),
]


@pytest.mark.parametrize(("kind", "fmt", "model_type", "architectures", "make"), EXPORTS, ids=[e[0] for e in EXPORTS])
def test_every_speculators_export_writes_and_reads_the_one_block(
    kind, fmt, model_type, architectures, make, verifier, tmp_path
):
    drafter, drafts = make()
    record = DrafterRecord(
        kind=kind, config=drafter.config.to_dict(), target=verifier, target_architectures=ARCHITECTURES,
        draft_tokens=drafts,
    )  # fmt: skip
    folder = get_kind(kind, "test").format(fmt).write(drafter, record, tmp_path / kind)
    config = json.loads((folder / "config.json").read_text())
    keys = list(config)
    assert keys[:3] == ["architectures", "speculators_model_type", "speculators_config"], keys
    assert keys[-2:] == ["dtype", "torch_dtype"] or kind == "peagle", keys  # P-EAGLE adds its two keys after
    assert config["architectures"] == architectures and config["dtype"] == config["torch_dtype"]
    assert config["speculators_config"] == {
        "algorithm": model_type,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafts}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": ARCHITECTURES},
    }
    block = speculators.folder_block(folder)
    assert (block.model_type, block.verifier, block.verifier_architectures) == (model_type, verifier, ARCHITECTURES)
    assert block.draft_tokens == drafts
    assert speculators.is_model_type(folder, model_type)
    others = {t for _, _, t, _, _ in EXPORTS} - {model_type}
    assert not any(speculators.is_model_type(folder, other) for other in others)
    found_kind, found_format = recognise(folder)
    assert (found_kind.name, found_format.name) == (kind, fmt)
    _, loaded = load_drafter(str(folder))
    assert loaded.kind == kind and loaded.target == verifier


def test_the_writer_refuses_what_speculators_cannot_load():
    fields, dtype = {"draft_vocab_size": 8}, torch.float32
    with pytest.raises(ValueError, match="names its verifier"):
        speculators.speculators_config("eagle3", ["Eagle3Speculator"], "", 3, None, fields, dtype)
    with pytest.raises(ValueError, match="speculative_tokens must be >= 1, got 0"):
        speculators.speculators_config("eagle3", ["Eagle3Speculator"], "t", 0, None, fields, dtype)
    config = speculators.speculators_config("x", ["XSpeculator"], "t", 2, None, fields, torch.bfloat16)
    assert list(config)[3:] == ["draft_vocab_size", "dtype", "torch_dtype"] and config["dtype"] == "bfloat16"
    assert config["speculators_config"]["verifier"]["architectures"] == []


def test_the_reader_reads_a_malformed_or_absent_block_as_absent():
    assert speculators.read_block({}) == speculators.SpeculatorsBlock(None, None, [], [])
    odd = {"speculators_model_type": "eagle3", "speculators_config": {"verifier": "x", "proposal_methods": ["y", {}]}}
    block = speculators.read_block(odd)
    assert (block.model_type, block.verifier, block.speculative_tokens, block.draft_tokens) == (
        "eagle3",
        None,
        [None],
        None,
    )
    with pytest.raises(ModelFolderError, match=r"where: speculators_model_type 'eagle3', expected 'dflash'"):
        speculators.check_model_type(odd, "dflash", "where")


def test_no_method_writes_or_reads_the_block_itself():
    """The block's keys are spelled in trainer/export/speculators.py alone (a method's exporter names its own keys)."""
    block_key = re.compile(r"""["'](speculators_config|proposal_methods|default_proposal_method)["']""")
    spelled = sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "trainer").rglob("*.py") if block_key.search(path.read_text())
    )
    assert spelled == ["trainer/export/speculators.py"], spelled
