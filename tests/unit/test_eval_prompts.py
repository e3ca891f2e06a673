"""What ``draftsmith eval --prompts`` reads from a held-out chat file (trainer/decoding/evaluate.py ``load_prompts``):
each conversation's prompt is the conversation before its closing assistant turns, rendered with the generation
prompt, so the held-out file a recipe validates on is also the prompts its fit hands to eval; and what a fit or an
export prints next when it knows no held-out prompts (how to measure, not a command with a placeholder)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from trainer.decoding.evaluate import load_prompts
from trainer.interface.output import NO_PROMPTS
from trainer.training.progress import next_commands

CHAT = [
    {"role": "user", "content": "Sort a list."},
    {"role": "assistant", "content": "sorted(xs)"},
    {"role": "user", "content": "And reversed?"},
    {"role": "assistant", "content": "sorted(xs, reverse=True)"},
]


def test_a_held_out_conversation_is_prompted_before_its_last_reply(tok, tmp_path):
    path = tmp_path / "heldout.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": CHAT[:3]}) + "\n")
    expected = tok(
        tok.apply_chat_template(CHAT[:3], add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    first, second = load_prompts(path, tok)
    assert first == second == expected.input_ids
    assert "reverse=True" not in tok.decode(first) and tok.decode(first).count("sorted(xs)") == 1


def test_a_conversation_of_replies_alone_is_refused_naming_its_line(tok, tmp_path):
    path = tmp_path / "heldout.jsonl"
    path.write_text(json.dumps({"messages": CHAT[:2]}) + "\n" + json.dumps({"messages": CHAT[1:2]}) + "\n")
    with pytest.raises(ValueError, match=r"heldout\.jsonl:2: the 'messages' hold no turn before the assistant's"):
        load_prompts(path, tok)


@pytest.mark.parametrize("val_files", [None, ["data/heldout.jsonl"]])
def test_the_fit_prints_eval_only_with_held_out_prompts_and_else_how_to_measure(val_files, tmp_path):
    from trainer.methods.draft_model.kind import KIND  # registers the kind

    record = SimpleNamespace(kind=KIND, target="org/target")
    module = SimpleNamespace(drafter_record=lambda: record)
    data = SimpleNamespace(val_files=val_files)
    trainer = SimpleNamespace(default_root_dir=str(tmp_path), callbacks=[], datamodule=data)
    commands, _, measure = next_commands(trainer, module, str(tmp_path / "last.ckpt"), None)
    assert commands[0].startswith("draftsmith export --ckpt_path ")
    if val_files is None:
        assert len(commands) == 1 and measure == NO_PROMPTS
    else:
        assert commands[1] == (
            f"draftsmith eval --target org/target --drafter {tmp_path / 'export'} --prompts data/heldout.jsonl "
            f"--output_dir {tmp_path / 'eval'}"
        )
        assert measure == ""
