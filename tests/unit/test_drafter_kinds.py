"""The drafter-kind registry: export and eval dispatch on a checkpoint's record, exported folders are recognised from
their files, and what no kind knows (or a drafter for another target) is refused naming the file, writing nothing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import tiny_llama
from tests.unit.test_eagle3_drafter import small_drafter
from trainer.decoding.evaluate import resolve_drafter
from trainer.decoding.options import ProposerOptions
from trainer.export.cli import export
from trainer.export.cli import main as export_main
from trainer.methods.draft_model import kind as hf_causal_lm
from trainer.methods.draft_model.proposer import DraftModelProposer
from trainer.methods.eagle3 import kind as eagle3_kind
from trainer.methods.eagle3.proposer import Eagle3Proposer, Eagle3TreeProposer
from trainer.training.registry import DrafterRecord, kinds, load_drafter, recognise


def training_checkpoint(path, module, record: DrafterRecord):
    """A checkpoint as the objectives write it: the module's weights under its component prefix, and the record."""
    (prefix,) = record.components.values()
    state = {prefix + k: v for k, v in module.state_dict().items()}
    torch.save({"state_dict": state, "drafter": record.to_dict()}, path)
    return path


@pytest.fixture
def student_ckpt(tmp_path):
    target = tiny_llama(0, vocab=64, dtype=torch.float32)
    target.save_pretrained(tmp_path / "target")
    student = tiny_llama(1, vocab=64, layers=1, dtype=torch.float32)
    record = hf_causal_lm.make_record(student, "student", str(tmp_path / "target"), target.config)
    return training_checkpoint(tmp_path / "student.ckpt", student, record), student, target


def test_the_built_in_kinds_and_their_formats() -> None:
    registered = kinds()
    assert {"hf_causal_lm", "eagle3"} <= set(registered)
    assert [f.name for f in registered["eagle3"].formats] == ["eagle3", "eagle3-speculators"]
    assert [f.name for f in registered["hf_causal_lm"].formats] == ["hf"]


def test_a_student_checkpoint_exports_and_evaluates_through_its_kind(student_ckpt, tmp_path) -> None:
    ckpt, student, target = student_ckpt
    out, fmt = export(str(ckpt), str(tmp_path / "hf"))  # the kind's default format
    assert fmt == "hf" and recognise(out)[1].name == "hf"
    exported = load_file(out / "model.safetensors")
    for key, value in student.state_dict().items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0)
    for path in (ckpt, out):  # the checkpoint itself, or its export: the same drafter
        proposer = resolve_drafter(str(path), target)
        assert isinstance(proposer, DraftModelProposer)
        ids = torch.randint(0, 64, (1, 9))
        torch.testing.assert_close(proposer.model(ids).logits, student(ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="drafts chains only"):
        resolve_drafter(str(ckpt), target, ProposerOptions(tree=True))


def test_an_eagle3_checkpoint_exports_both_formats_and_drafts_chains_and_trees(tmp_path) -> None:
    target = tiny_llama(2, vocab=50, hidden=16, layers=4, dtype=torch.float32)
    target.save_pretrained(tmp_path / "target")
    drafter, _ = small_drafter(3, target_hidden=16)
    drafter = drafter.float()
    record = eagle3_kind.make_record(drafter.config, str(tmp_path / "target"), ["LlamaForCausalLM"], ttt_steps=5)
    ckpt = training_checkpoint(tmp_path / "eagle3.ckpt", drafter, record)
    for fmt in ("eagle3", "eagle3-speculators"):
        out, _ = export(str(ckpt), str(tmp_path / fmt), fmt)
        module, reloaded = load_drafter(str(out))
        assert recognise(out)[1].name == fmt and reloaded.kind == "eagle3"
        for key, value in drafter.state_dict().items():
            torch.testing.assert_close(module.state_dict()[key], value, rtol=0, atol=0)
    config = json.loads((tmp_path / "eagle3-speculators" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5  # the TTT steps
    embedding = load_file(tmp_path / "eagle3-speculators" / "model.safetensors")["embed_tokens.weight"]
    torch.testing.assert_close(embedding, target.get_input_embeddings().weight, rtol=0, atol=0)
    assert isinstance(resolve_drafter(str(ckpt), target), Eagle3Proposer)
    tree = resolve_drafter(str(tmp_path / "eagle3"), target, ProposerOptions(tree=True, tree_nodes=9, tree_top_k=3))
    assert isinstance(tree, Eagle3TreeProposer) and (tree.budget, tree.top_k) == (9, 3)


def test_what_no_kind_knows_is_refused_naming_the_file_and_writing_nothing(student_ckpt, tmp_path, capsys) -> None:
    ckpt, student, target = student_ckpt
    out = tmp_path / "out"
    assert export_main(["--ckpt_path", str(ckpt), "--output_dir", str(out), "--format", "eagle3"]) == 2
    err = capsys.readouterr().err
    assert "kind 'hf_causal_lm' cannot be written as 'eagle3'; it writes: hf (" in err and not out.exists()
    data = torch.load(ckpt, weights_only=True)
    data["drafter"]["kind"] = "medusa-x"
    torch.save(data, tmp_path / "unknown.ckpt")
    assert export_main(["--ckpt_path", str(tmp_path / "unknown.ckpt"), "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown.ckpt: drafter kind 'medusa-x' is not one draftsmith knows" in err and not out.exists()
    del data["drafter"]
    torch.save(data, tmp_path / "no_record.ckpt")
    assert export_main(["--ckpt_path", str(tmp_path / "no_record.ckpt"), "--output_dir", str(out)]) == 2
    assert "holds no drafter record" in capsys.readouterr().err and not out.exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no drafter format recognised in this folder.*eagle3: eagle3, eagle3-specu"):
        load_drafter(str(tmp_path / "empty"))


def test_a_drafter_for_another_target_is_refused(tmp_path) -> None:
    drafter, _ = small_drafter(4, target_hidden=16)  # vocabulary 50, target width 16
    eagle3_kind.formats.save_native(drafter.float(), str(tmp_path / "eagle3"))
    wider = tiny_llama(5, vocab=50, hidden=32, layers=4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"eagle3: a drafter for another target: target hidden size 16, the target"):
        resolve_drafter(str(tmp_path / "eagle3"), wider)
    other_vocab = tiny_llama(6, vocab=64, hidden=16, layers=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="vocabulary of 50 tokens, the target has 64"):
        resolve_drafter(str(tmp_path / "eagle3"), other_vocab)
    shallow = tiny_llama(7, vocab=50, hidden=16, layers=2, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"reads target layers \[3\], the target has hidden states 0..2"):
        resolve_drafter(str(tmp_path / "eagle3"), shallow)
