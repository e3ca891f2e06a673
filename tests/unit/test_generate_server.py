"""`draftsmith generate --server` against a scripted fake OpenAI-compatible server: what is sent, what is written,
and every failure a clear error or a bounded retry, with nothing written twice (the real server:
tests/integration/test_generate_server.py)."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest

from tests.serving import FakeServer, free_port
from trainer import cli
from trainer.data import generate as gen
from trainer.data.server_client import ordered_map, same_model, server_base
from trainer.interface.errors import DataError, UsageError

MODEL = "org/tiny-target"


def chats(n: int = 7) -> list[dict]:
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "ORIGINAL"}]
        if i == 0:
            messages.insert(0, {"role": "system", "content": "be brief"})
        if i == 2:  # two assistant turns: the second request sees the first reply
            messages += [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": "ORIGINAL 2"}]
        if i == 4:
            messages = messages[:1]  # no assistant turn: kept, no request
        out.append({"id": i, "messages": messages})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(server: str, src: Path, out: Path, **options) -> gen.GenerateStats:
    kwargs = dict(
        target=MODEL, input_file=str(src), output_file=str(out), server=server, chunk_size=2, max_new_tokens=8
    )
    kwargs.update(progress=False, retry_wait=0.01, timeout=5.0)
    return gen.regenerate(**{**kwargs, **options})


def test_chat_rows_are_replaced_turn_by_turn_in_order(tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", chats())
    out = tmp_path / "out.jsonl"
    with FakeServer([MODEL]) as fake:
        stats = run(fake.url + "/v1/", src, out, concurrency=3)
    result = read_jsonl(out)
    assert [r["id"] for r in result] == list(range(7))
    assert result[4] == chats()[4]
    assert result[0]["messages"][0] == {"role": "system", "content": "be brief"}
    assert result[1]["messages"][1] == {"role": "assistant", "content": "question 1|1"}
    assert result[0]["messages"][2] == {"role": "assistant", "content": "question 0|2"}
    assert result[2]["messages"][1]["content"] == "question 2|1"
    assert result[2]["messages"][3]["content"] == "and then?|3"
    second = [r for r in fake.requests if len(r["messages"]) == 3 and r["messages"][-1]["content"] == "and then?"]
    assert second[0]["messages"][1] == {"role": "assistant", "content": "question 2|1"}  # the regenerated first
    assert len(fake.requests) == 7 and stats.turns == 7 and stats.written == 7 and stats.truncated == 0
    assert stats.tokens == sum(len(m["content"]) for r in result for m in r["messages"][1:] if m["role"] == "assistant")
    # greedy: temperature 0 and the token limit; nothing else about sampling is sent
    assert all(
        {k: r[k] for k in r if k not in ("messages",)}
        == {"model": MODEL, "max_tokens": 8, "temperature": 0.0, "stream": False, "n": 1}
        for r in fake.requests
    )
    meta = json.loads((tmp_path / "out.jsonl.meta.json").read_text())
    assert meta["server_model"] == MODEL and meta["servers"] == [fake.url] and meta["temperature"] == 0.0


def test_completions_sampling_cut_and_empty_replies(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"def f{i}(x):"} for i in range(5)])

    def reply(body, n):
        text = "" if body["prompt"] == "def f3(x):" else "+" + body["prompt"][-3:]
        return {"model": MODEL, "choices": [{"text": text, "finish_reason": "length"}], "usage": {}}

    with FakeServer([MODEL], reply) as fake:
        stats = run(fake.url, src, tmp_path / "o.jsonl", prompt_field="prompt", temperature=0.7, top_p=0.9, top_k=5)
    assert [r["text"] for r in read_jsonl(tmp_path / "o.jsonl")][:2] == ["def f0(x):+x):", "def f1(x):+x):"]
    assert stats.truncated == 5 and stats.empty == [3] and stats.tokens == 0  # no usage: 0 tokens counted
    body = next(r for r in fake.requests if r["prompt"] == "def f0(x):")
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.7, 0.9, 5)
    seeds = {r["prompt"]: r["seed"] for r in fake.requests}
    assert len(set(seeds.values())) == 5  # each record its own seed, the same on a rerun
    with FakeServer([MODEL], reply) as again:
        run(again.url, src, tmp_path / "o2.jsonl", prompt_field="prompt", temperature=0.7, top_p=0.9, top_k=5)
    assert {r["prompt"]: r["seed"] for r in again.requests} == seeds


def test_bad_values_are_named_and_leave_nothing(tmp_path, capsys):
    src = write_jsonl(tmp_path / "chat.jsonl", chats(3))
    out = tmp_path / "out.jsonl"
    with pytest.raises(UsageError, match=r"--server 'localhost:8000' is not an http\(s\) URL"):
        run("localhost:8000", src, out)
    with pytest.raises(UsageError, match="--concurrency 0 must be at least 1"):
        run("http://localhost:8000", src, out, concurrency=0)
    port = free_port()
    with pytest.raises(UsageError, match=rf"127.0.0.1:{port}/v1/models: .*connection refused"):
        run(f"http://127.0.0.1:{port}", src, out)
    with pytest.raises(UsageError, match="--served_model_name 'x' needs --server"):
        gen.regenerate(target=MODEL, input_file=str(src), output_file=str(out), served_model_name="x")
    assert not out.exists() and not (tmp_path / "out.jsonl.meta.json").exists()
    # through the command: one error line, exit status 2
    argv = [
        "generate",
        "--target",
        MODEL,
        "--input_file",
        str(src),
        "--output_file",
        str(out),
        "--server",
        "http://h:1",
    ]
    assert cli.main([*argv, "--concurrency", "0"]) == 2
    assert "error: generate: --concurrency 0 must be at least 1" in capsys.readouterr().err


def test_a_server_that_times_out_is_retried_then_named(tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", chats(3))
    out = tmp_path / "out.jsonl"

    def slow(body, n):
        time.sleep(1.0)
        return FakeServer.default_reply(fake, body, n)

    with FakeServer([MODEL], slow) as fake:
        with pytest.raises(UsageError, match=r"no answer after 2 tries .*no answer within --timeout 0.2 s"):
            run(fake.url, src, out, timeout=0.2, retries=1, concurrency=1)
    assert not out.exists()


def test_another_model_a_refused_key_and_a_missing_endpoint(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "chat.jsonl", chats(3))
    out = tmp_path / "out.jsonl"
    with FakeServer(["org/other-model"]) as fake:
        with pytest.raises(UsageError, match="serves 'org/other-model', not the target 'org/tiny-target'"):
            run(fake.url, src, out)
        assert not out.exists()
        with pytest.raises(UsageError, match="serves org/other-model, not --served_model_name 'org/tiny-target'"):
            run(fake.url, src, out, served_model_name=MODEL)
        assert run(fake.url, src, out, allow_model_mismatch=True).written == 3
    with FakeServer([MODEL, "b"]) as fake:
        with pytest.raises(UsageError, match="serves 2 models .* name the target's with --served_model_name"):
            run(fake.url, src, tmp_path / "o2.jsonl")
    with FakeServer([MODEL], key="sekret") as fake:
        with pytest.raises(UsageError, match=r"refused the request with no API key .*HTTP 401: Invalid API key"):
            run(fake.url, src, tmp_path / "o3.jsonl")
        monkeypatch.setenv("GEN_KEY", "wrong")
        with pytest.raises(UsageError, match=r"refused the request with the key in \$GEN_KEY \(HTTP 401"):
            run(fake.url, src, tmp_path / "o3.jsonl", api_key_env="GEN_KEY")
        with pytest.raises(UsageError, match="--api_key_env NO_SUCH_VAR: that environment variable is not set"):
            run(fake.url, src, tmp_path / "o3.jsonl", api_key_env="NO_SUCH_VAR")
        assert not (tmp_path / "o3.jsonl").exists()
        monkeypatch.setenv("GEN_KEY", "sekret")
        assert run(fake.url, src, tmp_path / "o3.jsonl", api_key_env="GEN_KEY").written == 3
    with FakeServer([MODEL]) as fake:
        with pytest.raises(UsageError, match=r"/api/v1/models does not exist on that server \(HTTP 404"):
            run(fake.url + "/api", src, tmp_path / "o4.jsonl")


def test_errors_500_and_429_are_retried_and_nothing_is_written_twice(tmp_path):
    records = chats(9)
    src = write_jsonl(tmp_path / "chat.jsonl", records)
    with FakeServer([MODEL]) as fake:
        run(fake.url, src, tmp_path / "straight.jsonl", concurrency=1)
    straight = (tmp_path / "straight.jsonl").read_text()

    def flaky(body, n):  # the first requests fail, one busy, then it answers
        if n < 2:
            return 500, {"detail": "out of memory"}, {}
        if n == 2:
            return 429, {"detail": "busy"}, {"Retry-After": "0"}
        return FakeServer.default_reply(fake, body, n)

    with FakeServer([MODEL], flaky) as fake:
        stats = run(fake.url, src, tmp_path / "flaky.jsonl", concurrency=2, retries=3)
    assert stats.written == 9 and (tmp_path / "flaky.jsonl").read_text() == straight

    # a server that breaks for good after a few requests: the finished chunks stay, a rerun resumes
    broken = {"after": 4}

    def breaks(body, n):
        if n >= broken["after"]:
            return 500, {"detail": "engine dead"}, {}
        return FakeServer.default_reply(fake, body, n)

    out = tmp_path / "resumed.jsonl"
    with FakeServer([MODEL], breaks) as fake:
        with pytest.raises(UsageError, match=r"record \d, assistant turn 0: .* no answer after 3 tries .*HTTP 500: en"):
            run(fake.url, src, out, concurrency=1, retries=2)
        assert read_jsonl(out) == read_jsonl(tmp_path / "straight.jsonl")[:2]  # one whole chunk, nothing partial
        broken["after"] = 10**6
        asked = len(fake.requests)
        stats = run(fake.url, src, out, concurrency=3)
    assert out.read_text() == straight and stats.written == 7
    assert len(fake.requests) - asked == 7  # records 2..8 (record 2 has two turns, record 4 none)


def test_malformed_replies_are_named_by_row(tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", chats(6))
    out = tmp_path / "out.jsonl"

    def no_choices(body, n):
        if body["messages"][-1]["content"] == "question 3":
            return {"model": MODEL, "choices": []}
        return FakeServer.default_reply(fake, body, n)

    with FakeServer([MODEL], no_choices) as fake:
        with pytest.raises(DataError, match=r"chat.jsonl record 3, assistant turn 0: the server answered without choi"):
            run(fake.url, src, out, concurrency=2)
    assert [r["id"] for r in read_jsonl(out)] == [0, 1]  # the chunk before it, once

    def too_long(body, n):
        if body["messages"][-1]["content"] == "question 5":
            return 400, {"error": {"message": "the prompt is longer than the context"}}, {}
        return FakeServer.default_reply(fake, body, n)

    with FakeServer([MODEL], too_long) as fake:
        with pytest.raises(UsageError, match=r"record 5, assistant turn 0: .* \(HTTP 400: the prompt is longer than"):
            run(fake.url, src, tmp_path / "o2.jsonl")
        assert len(fake.requests) == 6  # a refusal is not retried

    def other_model(body, n):
        return {**FakeServer.default_reply(fake, body, n), "model": "org/else"}

    with FakeServer([MODEL], other_model) as fake:
        with pytest.raises(UsageError, match="record 2, assistant turn 0: answered by model 'org/else'"):
            run(fake.url, src, out)


def test_server_urls_and_model_names():
    assert server_base("http://h:8000/v1/") == server_base("http://h:8000") == "http://h:8000"
    assert server_base("https://x.org/prefix/v1") == "https://x.org/prefix"
    with pytest.raises(UsageError, match="invalid port"):
        server_base("http://h:port")
    assert same_model("meta-llama/Llama-3.1-8B@main", "meta-llama/Llama-3.1-8B")
    assert same_model("/models/Llama-3.1-8B", "meta-llama/Llama-3.1-8B")
    assert not same_model("meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-8B")


def test_ordered_map_keeps_order_bounds_concurrency_and_raises_in_order():
    live, peak, lock = [0], [0], threading.Lock()

    def slow_square(x):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(random.random() * 0.01)
        with lock:
            live[0] -= 1
        if x == 30:
            raise ValueError("thirty")
        return x * x

    assert list(ordered_map(slow_square, range(30), concurrency=4, window=8)) == [x * x for x in range(30)]
    assert 1 < peak[0] <= 4
    got = []
    with pytest.raises(ValueError, match="thirty"):
        for value in ordered_map(slow_square, range(40), concurrency=4, window=8):
            got.append(value)
    assert got == [x * x for x in range(30)]
