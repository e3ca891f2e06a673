"""Chat data under chat templates as their models publish them (tests/fixtures/chat_templates/, each file verbatim
from its source, never edited): the trained tokens of every conversation are, written out by hand per template, each
assistant turn's content and the end-of-turn token that closes it (trainer/data/chat.py)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from trainer.data.chat import assistant_rows, has_generation_blocks
from trainer.data.tokenizer import CHAT_TEMPLATE
from trainer.interface.errors import DataError

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"

SYSTEM = {"role": "system", "content": "You write Python."}
TWO_TURNS = [
    {"role": "user", "content": "Sort a list."},
    {"role": "assistant", "content": "def f(xs):\n    return sorted(xs)"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome."},
]
CONVERSATIONS = {
    "one-turn": TWO_TURNS[:2],
    "one-turn-system": [SYSTEM, *TWO_TURNS[:2]],
    "two-turns": TWO_TURNS,
    "two-turns-system": [SYSTEM, *TWO_TURNS],
}


def trained_runs(tok, ids: list[int], trained: list[bool]) -> list[str]:
    """The decoded text of each run of consecutive trained tokens."""
    runs, position = [], 0
    for is_trained, group in itertools.groupby(trained):
        n = len(list(group))
        if is_trained:
            runs.append(tok.decode(ids[position : position + n]))
        position += n
    return runs


@pytest.fixture(scope="module")
def bundled(tiny_corpus):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_corpus.tokenizer_dir)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_rendering_before_and_through_each_turn_finds_what_generation_blocks_mark(bundled, name):
    """The bundled template marks its assistant turns with {% generation %}; without the blocks, the spans found by
    rendering before and through each turn are the same tokens, and the ids are the template's own."""
    messages = CONVERSATIONS[name]
    marked = bundled.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    plain = bundled.__class__.from_pretrained(bundled.name_or_path)
    plain.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert has_generation_blocks(bundled.chat_template) and not has_generation_blocks(plain.chat_template)
    [row] = assistant_rows(plain, messages, "conversations.jsonl:1")
    assert row.ids == list(marked["input_ids"]) and not row.per_turn
    assert row.trained == [bool(m) for m in marked["assistant_masks"]]
    expected = [m["content"] + "<|endoftext|>" for m in messages if m["role"] == "assistant"]
    assert trained_runs(plain, row.ids, row.trained) == expected


def test_a_generation_prompt_that_does_not_open_the_turn_is_refused_naming_it(bundled):
    tok = bundled.__class__.from_pretrained(bundled.name_or_path)
    tok.chat_template = (
        CHAT_TEMPLATE.replace("{% generation %}", "")
        .replace("{% endgeneration %}", "")
        .replace("{{ '<|assistant|>\n' }}", "{{ '<|assistant|>\n\n' }}")
    )
    with pytest.raises(DataError, match=r"chats.jsonl:3: assistant turn 1 \(message 2\): the chat template"):
        assistant_rows(tok, TWO_TURNS, "chats.jsonl:3")


CODE = "def f(xs):\n    return sorted(xs)"
THANKS = "You're welcome."
# (the fixture name in tests/real_shapes.py, what each conversation's rows train, written out by hand per template)
# Llama-3.1: the content and <|eot_id|>, every turn in one row.
# Qwen3: the template writes an empty think block before the content of the last assistant turn and none in earlier
# turns: a one-turn conversation is one row; a two-turn one gives a row per turn, each training its own turn.
# Qwen3.5: the same turns; its generation prompt already opens the think block ("<think>\n"), so a turn's trained
# text starts after it, at "</think>" (the "\n\n" token straddles the prompt's end: a token that starts in the prompt
# is not trained).
PUBLISHED = {
    "llama31_8b": {
        "one": [[f"{CODE}<|eot_id|>"]],
        "two": [[f"{CODE}<|eot_id|>", f"{THANKS}<|eot_id|>"]],
    },
    "qwen3_8b": {
        "one": [[f"<think>\n\n</think>\n\n{CODE}<|im_end|>"]],
        "two": [[f"<think>\n\n</think>\n\n{CODE}<|im_end|>"], [f"<think>\n\n</think>\n\n{THANKS}<|im_end|>"]],
    },
    "qwen3_5_9b": {
        "one": [[f"</think>\n\n{CODE}<|im_end|>"]],
        "two": [[f"</think>\n\n{CODE}<|im_end|>"], [f"</think>\n\n{THANKS}<|im_end|>"]],
    },
}


@pytest.fixture(scope="module")
def published_tokenizers(tmp_path_factory):
    """Each model's tokenizer (its real special tokens at their real ids, tests/real_shapes.py) with its published
    chat template, read verbatim from the fixture."""
    from tests.real_shapes import PUBLISHED_CHAT_TEMPLATE, build_tokenizer

    out = {}
    for name in PUBLISHED:
        tok = build_tokenizer(name, tmp_path_factory.mktemp(name))
        assert tok.chat_template == PUBLISHED_CHAT_TEMPLATE[name].read_text()
        assert not has_generation_blocks(tok.chat_template)  # why transformers' assistant mask marks nothing
        out[name] = tok
    return out


@pytest.mark.parametrize("name", list(PUBLISHED))
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_published_templates_train_each_assistant_turn_and_its_end_token(published_tokenizers, name, conversation):
    tok = published_tokenizers[name]
    messages = CONVERSATIONS[conversation]
    rows = assistant_rows(tok, messages, "chats.jsonl:1")
    expected = PUBLISHED[name]["two" if conversation.startswith("two") else "one"]
    assert [trained_runs(tok, row.ids, row.trained) for row in rows] == expected
    assert all(row.per_turn == (len(rows) > 1) for row in rows)
    # each row is the template's own rendering of the conversation (through the row's turn), tokenized as
    # apply_chat_template tokenizes it
    cut = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
    for row, end in zip(rows, cut if len(rows) > 1 else [len(messages) - 1]):
        assert row.ids == tok.apply_chat_template(messages[: end + 1], tokenize=True, return_dict=True)["input_ids"]
    # the system prompt is never trained, nor any user turn
    text = "".join(tok.decode([i]) for row in rows for i, t in zip(row.ids, row.trained) if t)
    assert "You write Python." not in text and "Sort a list." not in text and "Thanks" not in text


def test_a_published_template_trains_through_the_chat_data_module(published_tokenizers, tmp_path, caplog):
    """The data module trains the Llama-3.1 template's conversations (it refused every one for want of
    {% generation %} blocks) and Qwen3's, whose two-turn conversations give a row per turn, said once in the log:
    unpacked rows hold the trained tokens :func:`assistant_rows` gives, shifted to labels."""
    import logging

    from trainer.data.text import TextDataModule

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS.values()))
    for name in ("llama31_8b", "qwen3_8b"):
        tok = published_tokenizers[name]
        folder = tmp_path / f"tok_{name}"
        tok.save_pretrained(folder)
        module = TextDataModule(
            tokenizer=str(folder), train_files=[str(data)], format="chat", seq_len=160, batch_size=2, pack=False,
            shuffle=False, cache_dir=str(tmp_path / f"cache_{name}"), min_trained_fraction=0.0,
        )  # fmt: skip
        with caplog.at_level(logging.INFO):
            caplog.clear()
            module.setup("fit")
        rows = module.train_dataset
        expected = [row for m in CONVERSATIONS.values() for row in assistant_rows(tok, m, "x")]
        assert len(rows.ids) == len(expected) == (4 if name == "llama31_8b" else 6)
        for got_ids, got_trained, row in zip(rows.ids, rows.trained, expected):
            n = len(row.ids)
            assert got_ids[:n].tolist() == row.ids
            assert got_trained[:n].tolist() == row.trained
        said = [r.getMessage() for r in caplog.records if "one row per assistant turn" in r.getMessage()]
        assert len(said) == (0 if name == "llama31_8b" else 1) and all("2 conversations" in m for m in said), said
