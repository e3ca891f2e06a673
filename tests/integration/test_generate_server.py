"""`draftsmith generate --server` against a real `transformers serve` of the tiny target on a free localhost port:
the replies are the in-process greedy ones, and a server killed mid-run and restarted loses and repeats no row."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

from tests.integration.test_generate import conversations, read_jsonl, write_jsonl
from tests.serving import TransformersServe, require_serving
from trainer.data import generate as gen
from trainer.data.generate_io import ChunkWriter
from trainer.data.server_client import OpenAIClient

pytestmark = pytest.mark.slow

MAX_NEW = 12


@pytest.fixture(scope="module")
def served(tiny_target, tmp_path_factory):
    require_serving()
    server = TransformersServe(tiny_target, log=tmp_path_factory.mktemp("serve") / "serve.log")
    with server:  # started, and stopped at the end
        yield server


def options(target, src: Path, out: Path, **extra) -> dict:
    return (
        dict(
            target=str(target),
            input_file=str(src),
            output_file=str(out),
            chunk_size=2,
            max_new_tokens=MAX_NEW,
            progress=False,
        )
        | extra
    )


def test_server_replies_are_the_in_process_greedy_ones(served, tiny_target, tiny_corpus, tmp_path):
    """Token for token: the same text, and as many tokens generated (EOS included), with 4 requests in flight.

    Both run the model one prompt at a time (``--batch_size 1`` in-process: a left-padded batch may round
    differently), from the same weights and chat template; the server renders the template itself. The tiny target
    trained for 300 steps loops (on newlines after a chat prompt) rather than ending replies with EOS within 12
    tokens, so here every reply is cut at the limit, which both paths count alike."""
    src = write_jsonl(tmp_path / "chat.jsonl", conversations(tiny_corpus))
    local = gen.regenerate(**options(tiny_target, src, tmp_path / "local.jsonl", batch_size=1))
    remote = gen.regenerate(**options(tiny_target, src, tmp_path / "served.jsonl", server=served.url, concurrency=4))
    assert (tmp_path / "served.jsonl").read_text() == (tmp_path / "local.jsonl").read_text()
    assert (remote.turns, remote.tokens, remote.truncated) == (local.turns, local.tokens, local.truncated)
    assert local.tokens > 0
    meta = json.loads((tmp_path / "served.jsonl.meta.json").read_text())
    assert meta["server_model"] == str(tiny_target) and meta["servers"] == [served.url]

    texts = [json.loads(line)["text"] for line in Path(tiny_corpus.heldout_file).read_text().splitlines()[:2]]
    rows = [{"prompt": t[i : i + n]} for t in texts for i, n in ((0, 30), (90, 9))]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    mode = dict(prompt_field="prompt")
    local = gen.regenerate(**options(tiny_target, prompts, tmp_path / "lc.jsonl", batch_size=1, **mode))
    remote = gen.regenerate(**options(tiny_target, prompts, tmp_path / "sc.jsonl", server=served.url, **mode))
    assert (tmp_path / "sc.jsonl").read_text() == (tmp_path / "lc.jsonl").read_text()
    assert remote.tokens == local.tokens


def test_a_server_killed_mid_run_and_restarted_loses_and_repeats_no_row(
    served, tiny_target, tiny_corpus, tmp_path, monkeypatch, caplog
):
    """The server dies as record 3 is asked for (after the first chunk is written) and comes back on the same port
    while that request is retried: the output is the straight run's, each record once."""
    src = write_jsonl(tmp_path / "chat.jsonl", conversations(tiny_corpus))
    straight = tmp_path / "straight.jsonl"
    gen.regenerate(**options(tiny_target, src, straight, server=served.url))

    original_chat, original_write = OpenAIClient.chat, ChunkWriter.write
    calls, written, restarts = [], [], []

    def chat(self, model, messages, sampling, where):
        calls.append(where)
        if "record 3," in where and not restarts:
            served.kill()
            restarts.append(threading.Thread(target=served.start))
            restarts[0].start()
        return original_chat(self, model, messages, sampling, where)

    monkeypatch.setattr(OpenAIClient, "chat", chat)
    monkeypatch.setattr(
        ChunkWriter, "write", lambda w, chunk, first: (written.append(first), original_write(w, chunk, first))
    )
    out = tmp_path / "out.jsonl"
    with caplog.at_level(logging.WARNING, logger="trainer.data.server_client"):
        stats = gen.regenerate(**options(tiny_target, src, out, server=served.url, concurrency=1, retries=10))
    restarts[0].join()
    assert any("record 3," in c for c in calls) and "connection refused" in caplog.text  # it was retried
    assert written == [0, 2, 4, 6] and stats.written == 7
    assert out.read_text() == straight.read_text()
    assert [r["id"] for r in read_jsonl(out)] == list(range(7))
