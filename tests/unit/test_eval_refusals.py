"""``draftsmith eval`` refuses in one line what cannot be measured: a drafter export given as the target, and a
training checkpoint measured against a target other than the one whose fingerprint it recorded."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from tests.helpers import tiny_llama
from trainer.cli import main as draftsmith
from trainer.decoding.evaluate import check_trained_target, drafter_export
from trainer.export.cli import export
from trainer.interface.errors import CheckpointError
from trainer.methods.dflash import export as dflash_formats
from trainer.methods.dflash.module import DFlashConfig, DFlashDrafter
from trainer.methods.draft_model import kind as hf_causal_lm
from trainer.methods.layerskip import kind as layerskip
from trainer.methods.medusa import export as medusa_formats
from trainer.methods.medusa import kind as medusa_kind
from trainer.methods.medusa.module import MedusaConfig, MedusaDrafter
from trainer.methods.mtp import record as mtp_record
from trainer.methods.mtp.module import MTPConfig, MTPDrafter
from trainer.training.fingerprint import (
    EXPORT_RECORD,
    export_record,
    fingerprint,
    recorded_fingerprints,
    sample_differences,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = ["the cat sat on the mat and the dog sat on the log", "a b c d e f g h i j k l m n o p"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Two targets of one shape (other weights), a draft model, prompts, and drafter exports of several kinds."""
    root = tmp_path_factory.mktemp("refusals")
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(TEXT * 4, trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>")
    vocab = len(tokenizer)
    for name, seed in (("target", 0), ("other", 1), ("draft", 2)):
        tiny_llama(seed, vocab, dtype=torch.float32, eos_token_id=None).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXT))

    config = AutoConfig.from_pretrained(root / "target")
    medusa = MedusaDrafter(MedusaConfig(hidden_size=config.hidden_size, vocab_size=vocab, num_heads=2))
    medusa_formats.save_vllm(medusa, str(root / "medusa"))
    medusa_formats.save_tgi(medusa, str(root / "medusa_tgi"), base_model="org/base-model")
    dflash = DFlashDrafter(DFlashConfig.from_target(config, 1, (1,), block_size=4, mask_token_id=vocab - 1))
    dflash_formats.save_zlab(dflash, str(root / "dflash"))
    dflash_formats.save_speculators(
        dflash, str(root / "dflash_speculators"), str(root / "target"), ["LlamaForCausalLM"]
    )
    return root


def run_eval(root, target: str, drafter: str, *extra: str) -> int:
    argv = ["--target", target, "--drafter", drafter, "--prompts", str(root / "prompts.jsonl"), "--k", "2"]
    argv += ["--max_new_tokens", "6", "--temperature", "0", "--output_dir", str(root / "out"), *extra]
    return draftsmith(["eval", *argv])


# ---- a drafter export given as --target ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("folder", "kind", "fmt", "target"),
    [
        ("medusa", "medusa", "medusa", None),
        ("medusa_tgi", "medusa", "medusa-tgi", "org/base-model"),  # base_model_name_or_path
        ("dflash", "dflash", "dflash", None),  # a Qwen3 config (model_type qwen3), architectures DFlashDraftModel
        ("dflash_speculators", "dflash", "dflash-speculators", "TARGET"),  # speculators_config.verifier
    ],
)
def test_a_drafter_export_as_the_target_is_refused_naming_its_kind_and_target(root, capsys, folder, kind, fmt, target):
    target = str(root / "target") if target == "TARGET" else target
    assert drafter_export(root / folder) == (kind, fmt, target)
    assert run_eval(root, str(root / folder), "prompt-lookup") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and [line.split(":")[0] for line in err.splitlines()[-2:]] == ["error", "hint"]
    assert f"--target {root / folder}: a drafter export (kind {kind}, format {fmt}), not a target model" in err
    assert (f"its target is {target}" if target else "does not name its target") in err
    assert f"hint: pass it as --drafter {root / folder}" in err


def test_a_medusa2_export_names_the_trained_target_beside_its_heads(root, tmp_path):
    folder = tmp_path / "medusa2"
    shutil.copytree(root / "medusa", folder)
    shutil.copytree(root / "target", folder / "target")
    assert drafter_export(folder) == ("medusa", "medusa", str(folder / "target"))


def test_target_models_with_a_drafters_files_beside_them_are_targets(root, tmp_path):
    """The rule: a recognised format that is not the generic one, in a folder whose config names no class
    transformers builds. A LayerSkip export (an HF model with layerskip.json), an HF model, and a Qwen3.5 checkpoint
    with MTP modules (architectures ``Qwen3_5ForConditionalGeneration``, not ``*ForCausalLM``) are targets."""
    assert drafter_export(root / "target") is None  # kind hf_causal_lm's generic format
    layerskip_export = tmp_path / "layerskip"
    shutil.copytree(root / "target", layerskip_export)
    (layerskip_export / layerskip.MARKER).write_text(json.dumps({"kind": "layerskip", "early_exit_layers": [1]}))
    assert drafter_export(layerskip_export) is None
    qwen35 = tmp_path / "qwen3_5"
    qwen35.mkdir()
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"}
    (qwen35 / "config.json").write_text(json.dumps(config))
    save_file({"mtp.fc.weight": torch.zeros(2, 4)}, str(qwen35 / "model.safetensors"))  # qwen3-next recognises it
    assert drafter_export(qwen35) is None
    assert drafter_export(tmp_path / "missing") is None and drafter_export(tmp_path) is None  # no format


# ---- a training checkpoint against another target ----------------------------------------------------------------


def write_checkpoint(root, path, recorded_as: str = "target", frozen: bool = True) -> str:
    """A training checkpoint of a draft model trained against ``root/target``, as Objective.on_save_checkpoint
    writes one (the drafter record, and the target's fingerprint under ``frozen_models``)."""
    target = str(root / "target")
    config = AutoConfig.from_pretrained(target)
    draft = tiny_llama(2, config.vocab_size, dtype=torch.float32)
    record = hf_causal_lm.make_record(draft, "student", target, config)
    checkpoint = {
        "state_dict": {f"student.{k}": v for k, v in draft.state_dict().items()},
        "drafter": record.to_dict(),
    }
    if frozen:
        checkpoint["frozen_models"] = {recorded_as: fingerprint(target, config)}
    torch.save(checkpoint, path)
    return str(path)


@pytest.mark.parametrize("recorded_as", ["target", "teacher"])  # KD checkpoints record their target as the teacher
def test_a_checkpoint_measured_against_another_target_is_refused(root, tmp_path, capsys, recorded_as):
    ckpt = write_checkpoint(root, tmp_path / "last.ckpt", recorded_as)
    assert run_eval(root, str(root / "other"), ckpt) == 2
    err = capsys.readouterr().err
    trained, other = (fingerprint(str(root / n), AutoConfig.from_pretrained(root / n)) for n in ("target", "other"))
    assert "Traceback" not in err and [line.split(":")[0] for line in err.splitlines()[-2:]] == ["error", "hint"]
    assert f"--drafter {ckpt}: trained for another target" in err
    assert f"sample {trained['sample']}" in err and f"sample {other['sample']}" in err  # both fingerprints
    assert "they differ in sample" in err and "--allow_other_target" in err  # one shape: the weights' values differ
    # the flag measures it anyway; the target it was trained with, or a copy of it elsewhere, passes without one
    assert run_eval(root, str(root / "other"), ckpt, "--allow_other_target") == 0
    assert run_eval(root, str(root / "target"), ckpt) == 0
    copy = tmp_path / "copy_of_target"
    shutil.copytree(root / "target", copy)
    assert run_eval(root, str(copy), ckpt) == 0


def test_what_the_check_reads(root, tmp_path):
    ckpt = write_checkpoint(root, tmp_path / "last.ckpt")
    assert set(recorded_fingerprints(ckpt)) == {"target"}
    with pytest.raises(CheckpointError, match="they differ in sample"):
        check_trained_target(ckpt, str(root / "other"))
    check_trained_target(ckpt, str(root / "other"), allow_other_target=True)
    # a checkpoint without recorded frozen models (or an export, which has none) is left to check_target's shapes
    bare = write_checkpoint(root, tmp_path / "bare.ckpt", frozen=False)
    assert recorded_fingerprints(bare) == {}
    check_trained_target(bare, str(root / "other"))


# ---- exports, and drafters that carry the target they trained ----------------------------------------------------


def write_medusa_checkpoint(root, path) -> str:
    """A Medusa-1 training checkpoint of heads trained against ``root/target``, with the target's fingerprint."""
    target = str(root / "target")
    config = AutoConfig.from_pretrained(target)
    heads = MedusaDrafter(MedusaConfig(hidden_size=config.hidden_size, vocab_size=config.vocab_size, num_heads=2))
    record = medusa_kind.make_record(heads.config, target, config)
    checkpoint = {
        "state_dict": {f"drafter.{k}": v for k, v in heads.state_dict().items()},
        "drafter": record.to_dict(),
        "frozen_models": {"target": fingerprint(target, config)},
    }
    torch.save(checkpoint, path)
    return str(path)


def test_an_export_records_its_target_and_is_refused_against_another(root, tmp_path, capsys):
    ckpt = write_medusa_checkpoint(root, tmp_path / "medusa.ckpt")
    folder, _ = export(ckpt, str(tmp_path / "medusa_vllm"))
    config = AutoConfig.from_pretrained(root / "target")
    assert export_record(folder) == fingerprint(str(root / "target"), config)  # the fingerprint the checkpoint kept
    shutil.rmtree(root / "out", ignore_errors=True)
    assert run_eval(root, str(root / "other"), str(folder)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and [line.split(":")[0] for line in err.splitlines()[-2:]] == ["error", "hint"]
    assert f"--drafter {folder}: exported for another target: its {EXPORT_RECORD} records" in err
    assert "they differ in sample" in err
    assert not (root / "out").exists()
    assert run_eval(root, str(root / "other"), str(folder), "--allow_other_target") == 0
    copy = tmp_path / "copy_of_target"
    shutil.copytree(root / "target", copy)
    assert run_eval(root, str(copy), str(folder)) == 0


@pytest.mark.parametrize("folder", ["medusa", "medusa_tgi", "dflash", "dflash_speculators"])
def test_a_third_party_export_without_a_record_is_measured_with_one_warning(root, caplog, folder):
    """A folder another tool wrote (here: the format writers alone, as a third-party trainer would) holds no record:
    it is measured, and one warning line says that nothing but its vocabulary and shapes ties it to the target."""
    assert export_record(root / folder) is None
    with caplog.at_level(logging.WARNING, logger="trainer.decoding.evaluate"):
        assert run_eval(root, str(root / "other"), str(root / folder)) == 0
    warnings = [r.getMessage() for r in caplog.records if "records no target fingerprint" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith(f"--drafter {root / folder}: records no target fingerprint")
    assert f"--target {root / 'other'}" in warnings[0]


def write_mtp_checkpoint(root, path) -> str:
    """An MTP pre-training checkpoint: modules and the trunk trained with them, the trunk being ``root/target``'s
    weights (as a run that saved its trunk to ``root/target`` holds); no frozen model, so no fingerprint."""
    trunk = AutoModelForCausalLM.from_pretrained(root / "target")
    config = MTPConfig.for_trunk(trunk.config, depth=1)
    drafter = MTPDrafter(config, trunk)
    record = mtp_record.make_record(config, None, ["LlamaForCausalLM"], with_trunk=True, tokenizer=str(root / "target"))
    torch.save(
        {"state_dict": {f"drafter.{k}": v for k, v in drafter.state_dict().items()}, "drafter": record.to_dict()}, path
    )
    return str(path)


def test_an_mtp_checkpoint_with_its_own_trunk_is_refused_against_another_target(root, tmp_path, capsys):
    ckpt = write_mtp_checkpoint(root, tmp_path / "mtp.ckpt")
    assert recorded_fingerprints(ckpt) == {}  # nothing recorded: the trunk itself is compared
    shutil.rmtree(root / "out", ignore_errors=True)
    assert run_eval(root, str(root / "other"), ckpt) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and [line.split(":")[0] for line in err.splitlines()[-2:]] == ["error", "hint"]
    assert f"--drafter {ckpt}: it trained its target and carries it" in err
    assert f"--target {root / 'other'} is not that model" in err and "weights both hold differ" in err
    assert not (root / "out").exists()
    assert run_eval(root, str(root / "other"), ckpt, "--allow_other_target") == 0
    assert run_eval(root, str(root / "target"), ckpt) == 0


def safe_keys(path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def test_a_carried_target_is_compared_by_sampled_values(root, tmp_path):
    """The comparison against a naive one: every tensor the two hold, its first row rounded to bfloat16."""
    ours = AutoModelForCausalLM.from_pretrained(root / "target").state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(root / "other").state_dict()
    saved = safe_keys(root / "other" / "model.safetensors")  # what the folder's file holds (a tied lm_head is not)
    names = [n for n in ours if n in saved]
    naive = [
        n
        for n in sorted(names)
        if not torch.equal(*(m[n].flatten()[: m[n].shape[-1]][:16].bfloat16() for m in (ours, theirs)))
    ]
    assert sample_differences(ours, root / "other") == (len(names), naive)
    assert sample_differences({k: v.bfloat16() for k, v in ours.items()}, root / "target") == (len(names), [])
    assert sample_differences({"unrelated": torch.zeros(2)}, root / "target") == (0, [])


def test_a_target_with_an_empty_weights_file_is_refused_naming_it(root, tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(root / "target", target)
    (target / "model.safetensors").write_bytes(b"")
    assert run_eval(root, str(target), "prompt-lookup") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and [line.split(":")[0] for line in err.splitlines()[-2:]] == ["error", "hint"]
    assert f"--target {str(target)!r}: {target / 'model.safetensors'} is empty (0 bytes)" in err
