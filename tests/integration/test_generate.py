"""`draftsmith generate`: replies are the target's own greedy output, prompts are kept, a crash resumes exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.data import generate as gen
from trainer.data.generate_io import ChunkWriter, OutputLock
from trainer.data.text import TextDataModule
from trainer.interface.errors import UsageError

pytestmark = pytest.mark.slow

MAX_NEW = 10


def conversations(corpus) -> list[dict]:
    texts = [json.loads(line)["text"] for line in Path(corpus.heldout_file).read_text().splitlines()]
    snippets = [t[i : i + 40] for t in texts[:3] for i in (0, 200, 400)]
    out = []
    for n in range(7):
        a, b = snippets[n % len(snippets)], snippets[(n + 3) % len(snippets)]
        messages = [{"role": "user", "content": a}, {"role": "assistant", "content": "ORIGINAL " + b}]
        if n == 0:
            messages.insert(0, {"role": "system", "content": "be brief"})
        if n == 2:  # two assistant turns: the second sees the regenerated first
            messages += [{"role": "user", "content": b}, {"role": "assistant", "content": "ORIGINAL again"}]
        if n == 4:  # no assistant turn: kept as it is
            messages = messages[:1]
        out.append({"id": n, "messages": messages})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def reference(target_dir: Path, records: list[dict]) -> list[dict]:
    """The target's greedy replies, one conversation and one turn at a time, without padding."""
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    out = []
    for record in records:
        messages = [dict(m) for m in record["messages"]]
        for j, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            ids = tok.apply_chat_template(
                messages[:j], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            seq = model.generate(
                ids["input_ids"], max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=tok.pad_token_id
            )[0, ids["input_ids"].shape[1] :].tolist()
            seq = seq[: seq.index(tok.eos_token_id)] if tok.eos_token_id in seq else seq
            messages[j] = {"role": "assistant", "content": tok.decode(seq, skip_special_tokens=True)}
        out.append({**record, "messages": messages})
    return out


def args(target, src: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--target", str(target), "--input_file", str(src), "--output_file", str(out), "--batch_size", "3",
        "--chunk_size", "2", "--max_new_tokens", str(MAX_NEW), "--progress", "false", *extra,
    ]  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_replies_are_the_targets_greedy_output_and_prompts_are_kept(tiny_target, tiny_corpus, tmp_path):
    records = conversations(tiny_corpus)
    src = write_jsonl(tmp_path / "chat.jsonl", records)
    out = tmp_path / "regen.jsonl"
    assert gen.main(args(tiny_target, src, out)) == 0
    result = read_jsonl(out)
    assert [r["id"] for r in result] == [r["id"] for r in records]
    for before, after in zip(records, result, strict=True):
        assert [m["role"] for m in before["messages"]] == [m["role"] for m in after["messages"]]
        for a, b in zip(before["messages"], after["messages"], strict=True):
            if a["role"] == "assistant":
                assert not b["content"].startswith("ORIGINAL")
            else:
                assert a == b
    assert result == reference(tiny_target, records)

    # the chat datamodule reads the output and trains on the regenerated replies only
    dm = TextDataModule(
        tokenizer=str(tiny_corpus.tokenizer_dir), train_files=[str(out)], format="chat", seq_len=48, pack=False,
        batch_size=2, cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    dm.setup("fit")
    row = dm.train_dataset[0]
    assert row["loss_mask"].any() and not row["loss_mask"].all()

    # a parquet output holds the same records
    pq_out = tmp_path / "regen.parquet"
    assert gen.main(args(tiny_target, src, pq_out)) == 0
    import pyarrow.parquet as pq

    assert pq.read_table(pq_out).to_pylist() == result
    assert not (tmp_path / "regen.parquet.parts").exists()


def test_resume_after_a_crash_writes_every_record_once(tiny_target, tiny_corpus, tmp_path, monkeypatch):
    records = conversations(tiny_corpus)
    src = write_jsonl(tmp_path / "chat.jsonl", records)
    straight = tmp_path / "straight.jsonl"
    assert gen.main(args(tiny_target, src, straight)) == 0

    crashed = tmp_path / "crashed.jsonl"
    original = ChunkWriter.write
    calls = []

    def crash_on_third_chunk(self, chunk, first):
        calls.append(first)
        if len(calls) == 3:  # the process dies half-way through writing this chunk
            line = json.dumps(chunk[0]).encode()
            with self.output.open("ab") as f:
                f.write(line[: len(line) // 2])
            raise KeyboardInterrupt("killed")
        return original(self, chunk, first)

    monkeypatch.setattr(ChunkWriter, "write", crash_on_third_chunk)
    with pytest.raises(KeyboardInterrupt):
        gen.main(args(tiny_target, src, crashed))
    monkeypatch.setattr(ChunkWriter, "write", original)
    assert not crashed.read_text().endswith("\n")  # a partial line was left behind

    written = []
    monkeypatch.setattr(
        ChunkWriter, "write", lambda self, chunk, first: (written.append(first), original(self, chunk, first))
    )
    assert gen.main(args(tiny_target, src, crashed)) == 0
    assert written[0] == 4  # the two complete chunks were skipped
    assert crashed.read_text() == straight.read_text()
    assert [r["id"] for r in read_jsonl(crashed)] == list(range(len(records)))

    # a rerun with other settings is refused, naming the setting
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.main(args(tiny_target, src, crashed)[:-2] + ["--max_new_tokens", "3", "--progress", "false"])


def test_bad_input_is_named(tiny_target, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": "not a list"}\n')
    with pytest.raises(ValueError, match="bad.jsonl record 0"):
        gen.main(args(tiny_target, bad, tmp_path / "o.jsonl"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        gen.main(args(tiny_target, tmp_path / "missing.jsonl", tmp_path / "o.jsonl"))


def test_completion_mode_appends_the_targets_greedy_continuation(tiny_target, tiny_corpus, tmp_path):
    """--prompt_field: plain-text prompts of uneven lengths (left padding in a batch) get the target's own greedy
    continuation, one prompt at a time, without padding; TextDataModule trains on the ``text`` written."""
    texts = [json.loads(line)["text"] for line in Path(tiny_corpus.heldout_file).read_text().splitlines()[:2]]
    prompts = [t[i : i + n] for t in texts for i, n in ((0, 30), (100, 55), (300, 12))]
    src = write_jsonl(tmp_path / "prompts.jsonl", [{"id": n, "prompt": p} for n, p in enumerate(prompts)])
    out = tmp_path / "completions.jsonl"
    assert gen.main(args(tiny_target, src, out, "--prompt_field", "prompt")) == 0
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    tok = AutoTokenizer.from_pretrained(tiny_target)
    result = read_jsonl(out)
    assert [r["id"] for r in result] == list(range(len(prompts)))
    for record, prompt in zip(result, prompts, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        seq = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=tok.pad_token_id)[0]
        new = seq[ids.shape[1] :].tolist()
        new = new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
        assert record["prompt"] == prompt and record["text"] == prompt + tok.decode(new, skip_special_tokens=True)
    dm = TextDataModule(
        tokenizer=str(tiny_corpus.tokenizer_dir), train_files=[str(out)], seq_len=32, batch_size=2,
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    dm.setup("fit")
    assert len(dm.train_dataset) > 0

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": ""}])
    with pytest.raises(ValueError, match="bad.jsonl record 0: field 'prompt'"):
        gen.main(args(tiny_target, bad, tmp_path / "o.jsonl", "--prompt_field", "prompt"))


def test_a_second_run_writing_the_same_output_stops_at_once(tiny_target, tiny_corpus, tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", conversations(tiny_corpus)[:2])
    out = tmp_path / "regen.jsonl"
    other = OutputLock(out)  # the first run, still writing
    other.acquire()
    try:
        with pytest.raises(UsageError, match="another draftsmith generate is writing it"):
            gen.main(args(tiny_target, src, out))
        assert not out.exists() and not (tmp_path / "regen.jsonl.meta.json").exists()
    finally:
        other.release()
    assert gen.main(args(tiny_target, src, out)) == 0  # once it has ended
    assert len(read_jsonl(out)) == 2 and not (tmp_path / "regen.jsonl.lock").exists()


def test_a_target_that_does_not_load_writes_nothing(tiny_target, tiny_corpus, tmp_path, monkeypatch):
    """A misspelled --target is named as neither a local model folder nor a hub id, and leaves no output and no
    meta file behind: the corrected command then runs (it used to be refused by the meta file of the failed one)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the hub answers at once: not there
    monkeypatch.chdir(tmp_path)
    src = write_jsonl(tmp_path / "chat.jsonl", conversations(tiny_corpus)[:2])
    out = tmp_path / "out" / "regen.jsonl"
    no_config = tmp_path / "not_a_model"
    no_config.mkdir()
    cases = [
        ("artifacts/tiny_targte", "is not a local model folder or hub id"),  # a relative path: tried on the hub
        (str(tmp_path / "tiny_targte"), "no such folder"),
        (str(no_config), "is not a local model folder (no config.json in that directory)"),
    ]
    for target, message in cases:
        with pytest.raises(FileNotFoundError, match=re.escape(f"target {target!r}") + ".*" + re.escape(message)):
            gen.main(args(target, src, out))
        assert not (tmp_path / "out").exists()
    assert gen.main(args(tiny_target, src, out)) == 0
    assert len(read_jsonl(out)) == 2 and (tmp_path / "out" / "regen.jsonl.meta.json").is_file()
