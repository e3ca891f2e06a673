"""Knowledge distillation end to end, through the real CLI: export, assisted generation, resume, bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.recipe_runs import data_overrides, fit, kd_override, merge, record_batches
from trainer.export.cli import main as export_main

pytestmark = pytest.mark.slow


def test_student_is_an_hf_checkpoint_and_an_assistant_model(kd_student, tiny_target, tiny_corpus):
    student_dir, run = kd_student
    assert (student_dir / "model.safetensors").is_file() and (student_dir / "tokenizer.json").is_file()
    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    heldout = [json.loads(line)["text"] for line in Path(tiny_corpus.heldout_file).read_text().splitlines()]
    for text in heldout[:4]:
        prompt = tokenizer(text[:200], return_tensors="pt").input_ids[:, :24]
        settings = dict(max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        alone = target.generate(prompt, **settings)
        assisted = target.generate(prompt, assistant_model=student, **settings)
        assert torch.equal(alone, assisted)

    # the checkpoint exports to the same weights as the student saved at the end of fit
    exported = run / "exported"
    assert export_main(["--ckpt_path", str(run / "checkpoints" / "last.ckpt"), "--output_dir", str(exported)]) == 0
    a, b = load_file(student_dir / "model.safetensors"), load_file(exported / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    reloaded = AutoModelForCausalLM.from_pretrained(exported).eval()
    ids = torch.randint(0, student.config.vocab_size, (2, 16))
    torch.testing.assert_close(reloaded(ids).logits, student(ids).logits, rtol=0, atol=0)
    # the resolved config sits beside the checkpoints
    assert (run / "checkpoints" / "config.yaml").is_file()


@pytest.mark.parametrize(("stop_at", "optimizer"), [(4, "adamw"), (5, "muon")])
def test_resume_gives_the_same_batches_and_weights(stop_at, optimizer, tiny_corpus, tiny_target, tmp_path):
    """Stopped at a checkpoint step (4), or between two (5, as trainer.max_time stops: last.ckpt is then written at
    the end of training by the objective), then resumed from last: the same batches and weights as a straight run,
    with AdamW and with ``optim.name: muon`` (whose momentum and AdamW moments the checkpoint carries)."""
    optim = ("--model.init_args.optim.name", optimizer)
    straight = tmp_path / "straight"
    fit(
        "quickstart/kd.yaml",
        kd_override(straight, tiny_corpus, tiny_target, 8, 4, callbacks=[record_batches(straight)]),
        straight,
        optim,
    )

    split = tmp_path / "split"
    stop = {"class_path": "tests.callbacks.StopAtStep", "init_args": {"step": stop_at}}
    fit(
        "quickstart/kd.yaml",
        kd_override(split, tiny_corpus, tiny_target, 8, 4, callbacks=[record_batches(split), stop]),
        split,
        optim,
    )
    fit(
        "quickstart/kd.yaml",
        kd_override(split, tiny_corpus, tiny_target, 8, 4, callbacks=[record_batches(split)]),
        split,
        (*optim, "--ckpt_path", "last"),
    )

    def lines(run):
        return [json.loads(line) for line in (run / "batches.jsonl").read_text().splitlines()]

    assert [r["batch"] for r in lines(straight)] == [r["batch"] for r in lines(split)]
    assert [r["step"] for r in lines(split)] == list(range(8))
    # the final checkpoint holds the student only: the frozen teacher is rebuilt from its path, fingerprinted (the
    # newest last*.ckpt, as --ckpt_path last resolves it: the two runs' different callback lists give their
    # ModelCheckpoints different state keys, so the resumed run versions its file)
    newest = max((split / "checkpoints").glob("last*.ckpt"), key=lambda p: p.stat().st_mtime)
    saved = torch.load(newest, map_location="cpu", weights_only=True)
    assert saved["state_dict"] and all(k.startswith("student.") for k in saved["state_dict"])
    # the tokens seen count on across the resume (what draftsmith compare reports as training tokens)
    assert saved["global_step"] == 8 and saved["tokens_seen"] == 8 * 4 * 64
    assert saved["frozen_models"]["teacher"]["path"] == str(tiny_target)
    moments = [set(state) for state in saved["optimizer_states"][0]["state"].values()]
    assert any("exp_avg" in m for m in moments)  # AdamW's, for every parameter or (Muon) the embeddings and vectors
    assert any("momentum_buffer" in m for m in moments) == (optimizer == "muon")
    a, b = load_file(straight / "student" / "model.safetensors"), load_file(split / "student" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_missing_data_file_is_named(tiny_corpus, tiny_target, tmp_path):
    override = kd_override(tmp_path, tiny_corpus, tiny_target, 2, 2)
    override["data"]["init_args"]["train_files"] = [str(tmp_path / "nope.jsonl")]
    with pytest.raises(Exception, match="nope.jsonl"):
        fit("quickstart/kd.yaml", override, tmp_path)


def test_empty_data_set_is_refused(tiny_corpus, tiny_target, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    override = kd_override(tmp_path, tiny_corpus, tiny_target, 2, 2)
    override["data"]["init_args"]["train_files"] = [str(empty)]
    with pytest.raises(Exception, match="empty"):
        fit("quickstart/kd.yaml", override, tmp_path)


def test_vocabulary_mismatch_is_refused(tiny_corpus, tiny_target, tmp_path):
    from trainer.data.corpus import prepare_corpus

    other = prepare_corpus(str(tmp_path / "other"), vocab_size=300, seed=1, max_files=20)
    override = merge(kd_override(tmp_path, tiny_corpus, tiny_target, 2, 2), data_overrides(other))
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        fit("quickstart/kd.yaml", override, tmp_path / "run")


def test_nan_loss_is_an_error_naming_the_step(tiny_corpus, tiny_target, tmp_path):
    broken = AutoModelForCausalLM.from_pretrained(tiny_target)
    with torch.no_grad():
        broken.lm_head.weight[0, 0] = float("nan")  # every logit row gets a NaN: the loss is NaN from step 0
    broken.save_pretrained(tmp_path / "broken")
    AutoTokenizer.from_pretrained(tiny_target).save_pretrained(tmp_path / "broken")
    override = kd_override(tmp_path, tiny_corpus, tmp_path / "broken", 3, 3)
    with pytest.raises(FloatingPointError, match="global step"):
        fit("quickstart/kd.yaml", override, tmp_path)


def test_a_run_bounded_by_time_alone_needs_a_constant_schedule(tiny_corpus, tiny_target, tmp_path):
    """trainer.max_time without max_steps: a decaying schedule has no length, so it is refused with the keys named;
    optim.decay constant trains (and stops at the time limit)."""
    override = kd_override(tmp_path, tiny_corpus, tiny_target, -1, 2)
    override["trainer"]["max_time"] = "00:00:00:03"
    with pytest.raises(ValueError, match="optim.decay='cosine'.*trainer.max_steps"):
        fit("quickstart/kd.yaml", override, tmp_path / "cosine")
    override["model"]["init_args"]["optim"] = {"decay": "constant", "lr": 0.002, "warmup_steps": 2}
    cli = fit("quickstart/kd.yaml", override, tmp_path / "constant")
    assert cli.trainer.global_step > 0


def test_last_checkpoint_holds_the_final_step(tiny_corpus, tiny_target, tmp_path):
    """5 steps with a checkpoint every 2: Lightning alone leaves last.ckpt at step 4; the objective writes step 5, the
    weights the run ends with (and exports)."""
    cli = fit("quickstart/kd.yaml", kd_override(tmp_path, tiny_corpus, tiny_target, 5, 2), tmp_path)
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert cli.trainer.global_step == 5 and saved["global_step"] == 5
    student = cli.model.student.state_dict()
    saved_student = {k.removeprefix("student."): v for k, v in saved["state_dict"].items() if k.startswith("student.")}
    assert saved_student.keys() == student.keys()
    for key, value in saved_student.items():
        torch.testing.assert_close(value, student[key], rtol=0, atol=0)


def test_resume_with_another_teacher_is_refused_naming_both(tiny_corpus, tiny_target, tmp_path):
    """The checkpoint keeps the teacher's fingerprint, not its weights: a different teacher at the same path (one
    weight changed) is refused on resume with both fingerprints in the message."""
    teacher = tmp_path / "teacher"
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    model.save_pretrained(teacher)
    AutoTokenizer.from_pretrained(tiny_target).save_pretrained(teacher)
    run = tmp_path / "run"
    fit("quickstart/kd.yaml", kd_override(run, tiny_corpus, teacher, 2, 2), run)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0
    model.save_pretrained(teacher)
    resumed = kd_override(run, tiny_corpus, teacher, 4, 2)
    with pytest.raises(
        ValueError, match=r"another teacher: it recorded \(path .* sample (\w+)\), this run loads"
    ) as err:
        fit("quickstart/kd.yaml", resumed, run, ("--ckpt_path", "last"))
    recorded, loaded = re.findall(r"sample (\w+)", str(err.value))
    assert recorded != loaded


def test_quickstart_fit_logs_tau_with_the_speculative_eval_callback(tiny_corpus, tiny_target, tmp_path):
    """The callback of the quickstart recipes, on the held-out file: tau and acceptance per position are TensorBoard
    scalars of the run."""
    callback = {
        "class_path": "trainer.decoding.callback.SpeculativeEvalCallback",
        "init_args": {
            "prompts": str(tiny_corpus.heldout_file), "prompt_tokens": 24, "k": 3, "max_new_tokens": 12,
            "every_n_steps": 2, "max_prompts": 2, "temperature": 1.0,
        },
    }  # fmt: skip
    fit("quickstart/kd.yaml", kd_override(tmp_path, tiny_corpus, tiny_target, 4, 4, callbacks=[callback]), tmp_path)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((tmp_path / "tensorboard").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"spec_eval/tau", "spec_eval/acceptance_1", "spec_eval/acceptance_3", "spec_eval/tau_sampling"} <= scalars
    taus = [e.value for e in events.Scalars("spec_eval/tau")]
    assert [e.step for e in events.Scalars("spec_eval/tau")] == [2, 4] and all(1.0 <= t <= 4.0 for t in taus)


def test_a_learning_rate_that_kills_the_student_stops_the_run_and_exports_nothing(tiny_corpus, tiny_target, tmp_path):
    """lr 1e6: weights in the millions and a gradient of exactly 0 from the next step on; the run stops with an error
    naming the learning rate instead of ending "successfully" and exporting a dead student."""
    override = kd_override(tmp_path, tiny_corpus, tiny_target, 12, 12)
    override["model"]["init_args"]["optim"] = {"lr": 1e6, "warmup_steps": 0}
    with pytest.raises(FloatingPointError, match=r"optim.lr=1000000.0"):
        fit("quickstart/kd.yaml", override, tmp_path)
    assert not (tmp_path / "student").exists()
