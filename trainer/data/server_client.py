"""``draftsmith generate --server``: the target's replies from a running OpenAI-compatible server.

vLLM (``vllm serve``), SGLang (``python -m sglang.launch_server``) and ``transformers serve`` all answer
``POST /v1/chat/completions`` (chat rows: the server renders its chat template) and ``POST /v1/completions`` (plain
prompts), and list what they serve at ``GET /v1/models``. This module holds the client (the standard library's
``urllib``, no dependency) and the bounded pool of threads that keeps ``concurrency`` requests in flight.

- Every request has a timeout; connection errors (refused, reset, closed), timeouts, HTTP 429 and 5xx are retried
  with exponential backoff (``Retry-After`` honoured), ``retries`` times; then the error names the URL and the last
  reason. A refused API key (401, 403), an unknown endpoint (404) and any other refusal (4xx, with the server's own
  message) end the run at once.
- Nothing here writes: :func:`ordered_map` hands results back in input order, so the caller writes whole chunks only,
  and an error (or Ctrl-C) leaves in-flight requests behind (daemon threads) without writing any of them.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from trainer.interface.errors import DataError, UsageError

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

MAX_WAIT_S = 30.0  # the longest pause between two tries
RETRIED_STATUS = (408, 429, 500, 502, 503, 504)


def server_base(url: str) -> str:
    """The server's base URL (``scheme://host:port[/prefix]``, without a trailing ``/v1``), refusing one without a
    scheme or host, naming the value."""
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise UsageError(
            f"generate: --server {url!r} is not an http(s) URL", hint="give the scheme and host: http://localhost:8000"
        )
    try:
        parsed.port  # noqa: B018 -- raises on a port that is not a number
    except ValueError as err:
        raise UsageError(f"generate: --server {url!r} has an invalid port ({err})") from err
    path = parsed.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


@dataclass(frozen=True)
class Reply:
    """One reply of the server: its text, whether it was cut at the token limit (``finish_reason`` "length"), the
    tokens it generated (``usage.completion_tokens``, 0 when the server does not say) and the model that answered."""

    text: str
    cut: bool
    tokens: int
    model: str


class OpenAIClient:
    """Requests to one OpenAI-compatible server, retried on transient failures."""

    def __init__(
        self,
        url: str,
        api_key_env: str | None = None,
        timeout: float = 600.0,
        retries: int = 6,
        retry_wait: float = 1.0,
    ) -> None:
        """
        Args:
            url: the server's base URL (``http://host:port``; a trailing ``/v1`` is accepted).
            api_key_env: the environment variable holding the API key sent as a bearer token (None: no key).
            timeout: seconds a request may take before it is abandoned (and retried).
            retries: how many times a failed request is tried again before the run ends.
            retry_wait: the first pause between tries, in seconds; it doubles at every try (up to 30 s).
        """
        self.base = server_base(url)
        self.url = url
        self.api_key_env = api_key_env
        self.timeout, self.retries, self.retry_wait = timeout, retries, retry_wait
        self.api_key = None
        if api_key_env:
            self.api_key = os.environ.get(api_key_env)
            if not self.api_key:
                raise UsageError(f"generate: --api_key_env {api_key_env}: that environment variable is not set")

    # -- requests ------------------------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: dict[str, Any] | None = None, retries: int | None = None) -> Any:
        """The JSON answer of ``method path``; transient failures are tried ``retries`` more times (default: the
        client's)."""
        retries = self.retries if retries is None else retries
        url = self.base + path
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        started = time.monotonic()
        for attempt in range(retries + 1):
            try:
                request = urllib.request.Request(url, data=data, headers=headers, method=method)
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
                break
            except urllib.error.HTTPError as err:
                detail = _detail(err)
                if err.code not in RETRIED_STATUS:
                    raise self._refusal(url, err.code, detail) from None
                reason, wait = f"HTTP {err.code}: {detail}", _retry_after(err)
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, OSError) as err:
                reason, wait = _connection_reason(err, self.timeout), None
            if attempt == retries:
                raise UsageError(
                    f"generate: {url}: no answer after {retries + 1} tries over {time.monotonic() - started:.0f} s "
                    f"(last: {reason})",
                    hint="check that the server runs at --server and answers; --retries, --retry_wait and --timeout "
                    "set how long draftsmith waits",
                )
            pause = min(MAX_WAIT_S, self.retry_wait * 2**attempt) if wait is None else min(MAX_WAIT_S, wait)
            pause *= 1 + 0.1 * random.random()  # jitter: concurrent requests do not come back all at once
            log.warning("%s: %s; trying again in %.1f s (%d of %d)", url, reason, pause, attempt + 1, retries)
            time.sleep(pause)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataError(f"generate: {url} answered with something that is not JSON: {raw[:200]!r}") from err

    def _refusal(self, url: str, status: int, detail: str) -> UsageError:
        if status in (401, 403):
            where = f"the key in ${self.api_key_env}" if self.api_key_env else "no API key (--api_key_env not set)"
            return UsageError(
                f"generate: {url} refused the request with {where} (HTTP {status}: {detail})",
                hint="name the environment variable that holds the server's key with --api_key_env",
            )
        if status == 404:
            return UsageError(
                f"generate: {url} does not exist on that server (HTTP 404: {detail})",
                hint="--server takes the server's base URL, such as http://localhost:8000",
            )
        return UsageError(f"generate: {url} refused the request (HTTP {status}: {detail})")

    # -- the OpenAI API ------------------------------------------------------------------------------------------

    def models(self) -> list[str]:
        """The ids ``GET /v1/models`` lists. A server that nothing answers for is an error at once (no retries)."""
        answer = self.request("GET", "/v1/models", retries=0)
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise DataError(f"generate: {self.base}/v1/models answered without a model list: {str(answer)[:200]}")
        return [m["id"] for m in data]

    def chat(self, model: str, messages: list[dict[str, str]], sampling: dict[str, Any], where: str) -> Reply:
        """The reply to a conversation ending before the assistant's turn (the server's chat template)."""
        body = {"model": model, "messages": messages, "stream": False, "n": 1, **sampling}
        answer = self._post("/v1/chat/completions", body, where)
        choice = _first_choice(answer, where)
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else None
        if text is None and isinstance(message, dict) and "content" in message:
            text = ""  # a reply of no text (content null)
        if not isinstance(text, str):
            raise DataError(f"{where}: the server's reply has no message content: {str(answer)[:300]}")
        return _reply(answer, choice, text, where)

    def _post(self, path: str, body: dict[str, Any], where: str) -> Any:
        """The answer to a request for one record, whose failure names the record (``where``)."""
        try:
            return self.request("POST", path, body)
        except (UsageError, DataError) as err:
            raise type(err)(f"{where}: {err.message}", err.hint) from err

    def complete(self, model: str, prompt: str, sampling: dict[str, Any], where: str) -> Reply:
        """The continuation of a plain-text prompt (no chat template)."""
        body = {"model": model, "prompt": prompt, "stream": False, "n": 1, **sampling}
        answer = self._post("/v1/completions", body, where)
        choice = _first_choice(answer, where)
        text = choice.get("text")
        if not isinstance(text, str):
            raise DataError(f"{where}: the server's completion has no text: {str(answer)[:300]}")
        return _reply(answer, choice, text, where)


def _first_choice(answer: Any, where: str) -> dict[str, Any]:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise DataError(f"{where}: the server answered without choices: {str(answer)[:300]}")
    return choices[0]


def _reply(answer: dict[str, Any], choice: dict[str, Any], text: str, where: str) -> Reply:
    usage = answer.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    model = answer.get("model")
    model = model if isinstance(model, str) else ""
    return Reply(text, choice.get("finish_reason") == "length", int(tokens or 0), model)


def _detail(err: urllib.error.HTTPError) -> str:
    """The server's error message: FastAPI's ``detail``, OpenAI's ``error.message``, or the body's start."""
    try:
        body = err.read().decode("utf-8", "replace")
    except OSError:
        return err.reason or ""
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:300] or str(err.reason)
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:300]
        for key in ("detail", "message", "error"):
            if parsed.get(key):
                return str(parsed[key])[:300]
    return body.strip()[:300]


def _retry_after(err: urllib.error.HTTPError) -> float | None:
    value = err.headers.get("Retry-After") if err.headers else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _connection_reason(err: BaseException, timeout: float) -> str:
    reason = err.reason if isinstance(err, urllib.error.URLError) else err
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"no answer within --timeout {timeout:g} s"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused: nothing listens there"
    return f"{type(reason).__name__}: {reason}"


# ---------------------------------------------------------------------------------------------------------------------
# Served model against the target.


def _bare(name: str) -> str:
    """A model name without a hub revision (``org/model@main``) or trailing slash."""
    name = name.rstrip("/")
    return name.rsplit("@", 1)[0] if "@" in name.rsplit("/", 1)[-1] else name


def same_model(served: str, target: str) -> bool:
    """Whether a served model name stands for ``target``: the same name (a hub revision aside), the same local
    folder, or the same last path component (``/models/Llama-3.1-8B`` for ``meta-llama/Llama-3.1-8B``)."""
    a, b = _bare(served), _bare(target)
    if a == b or os.path.basename(a) == os.path.basename(b):
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def served_model(client: OpenAIClient, model: str | None, target: str, allow_mismatch: bool) -> str:
    """The model name to request: ``model``, or the one model the server lists; refused when the server does not
    serve it, or when it is not ``target`` (unless ``allow_mismatch``)."""
    listed = client.models()
    if model is None:
        if len(listed) != 1:
            raise UsageError(
                f"generate: the server at {client.base} serves {len(listed)} models ({', '.join(listed) or 'none'}): "
                "name the target's with --served_model_name"
            )
        model = listed[0]
    elif listed and not any(_bare(m) == _bare(model) for m in listed):
        raise UsageError(
            f"generate: the server at {client.base} serves {', '.join(listed)}, not --served_model_name {model!r}"
        )
    if not allow_mismatch and not same_model(model, target):
        raise UsageError(
            f"generate: the server at {client.base} serves {model!r}, not the target {target!r}",
            hint="start the server with the target, or pass --allow_model_mismatch true if it is the target under "
            "another name (vLLM's --served-model-name)",
        )
    return model


# ---------------------------------------------------------------------------------------------------------------------
# Records through the server.


@dataclass
class RecordReply:
    """One record regenerated by the server: the new record, its replies, those cut at the token limit, the tokens
    generated and whether a reply came back empty."""

    record: dict[str, Any]
    turns: int
    truncated: int
    tokens: int
    empty: bool


class ServerRegenerator:
    """Regenerates one record at a time through the server (the caller runs several at once): a chat record's
    assistant turns in order, each the reply to the conversation so far, or a plain prompt's continuation."""

    def __init__(
        self,
        client: OpenAIClient,
        model: str,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
        source: str,
    ) -> None:
        """
        Args:
            client: the server's client.
            model: the model name to request (checked against the target).
            max_new_tokens: longest reply, in tokens (``max_tokens``).
            temperature: sampling temperature; 0 decodes greedily (``top_p``, ``top_k`` and ``seed`` are then not
                sent).
            top_p: nucleus sampling threshold, sent when sampling and below 1.
            top_k: top-k sampling, sent when sampling and above 0 (an extension of vLLM and SGLang).
            seed: seeds each request (with the record index and turn), sent when sampling.
            source: the input file, named in errors.
        """
        self.client, self.model, self.source = client, model, source
        self.max_new_tokens, self.temperature, self.top_p, self.top_k, self.seed = (
            max_new_tokens, temperature, top_p, top_k, seed,
        )  # fmt: skip

    def sampling(self, index: int, turn: int) -> dict[str, Any]:
        """The sampling fields of the request for reply ``turn`` of record ``index``."""
        fields: dict[str, Any] = {"max_tokens": self.max_new_tokens, "temperature": float(self.temperature)}
        if self.temperature > 0:
            digest = hashlib.sha256(f"{self.seed}:generate:{index}:{turn}".encode()).digest()
            fields["seed"] = int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
            if self.top_p < 1:
                fields["top_p"] = self.top_p
            if self.top_k > 0:
                fields["top_k"] = self.top_k
        return fields

    def _checked(self, reply: Reply, where: str) -> Reply:
        if reply.model and not same_model(reply.model, self.model):
            raise UsageError(
                f"{where}: answered by model {reply.model!r}, not {self.model!r} (was the server restarted with "
                "another model?)"
            )
        return reply

    def chat_record(self, record: dict[str, Any], index: int, messages_field: str) -> RecordReply:
        """``record`` with each assistant turn replaced, in order, by the server's reply to the turns before it."""
        messages = [dict(m) for m in record[messages_field]]
        turns = truncated = tokens = 0
        empty = False
        for j, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            where = f"{self.source} record {index}, assistant turn {turns}"
            sent = [{"role": m["role"], "content": m["content"]} for m in messages[:j]]
            reply = self._checked(self.client.chat(self.model, sent, self.sampling(index, turns), where), where)
            messages[j] = {**message, "content": reply.text}
            turns, truncated, tokens = turns + 1, truncated + int(reply.cut), tokens + reply.tokens
            empty = empty or not reply.text.strip()
        return RecordReply({**record, messages_field: messages}, turns, truncated, tokens, empty)

    def completion_record(self, record: dict[str, Any], index: int, prompt_field: str) -> RecordReply:
        """``record`` with ``text``, its prompt followed by the server's continuation."""
        where = f"{self.source} record {index}"
        prompt = record[prompt_field]
        reply = self._checked(self.client.complete(self.model, prompt, self.sampling(index, 0), where), where)
        empty = not reply.text.strip()
        return RecordReply({**record, "text": prompt + reply.text}, 1, int(reply.cut), reply.tokens, empty)


# ---------------------------------------------------------------------------------------------------------------------
# A bounded pool that hands results back in order.


def ordered_map(fn: Callable[[T], R], items: Iterable[T], concurrency: int, window: int) -> Iterator[R]:
    """``fn(item)`` for each item, in order, with up to ``concurrency`` calls running at once in daemon threads and
    at most ``window`` items started ahead of the one the caller waits for. The first exception (in input order) is
    raised to the caller; the calls then in flight are abandoned (their results are never handed back)."""
    items = list(items)
    cond = threading.Condition()
    results: dict[int, tuple[bool, Any]] = {}
    state = {"next": 0, "consumed": 0, "stop": False}

    def worker() -> None:
        while True:
            with cond:
                while not state["stop"] and state["next"] < len(items) and state["next"] >= state["consumed"] + window:
                    cond.wait()
                if state["stop"] or state["next"] >= len(items):
                    return
                k = state["next"]
                state["next"] += 1
            try:
                out: tuple[bool, Any] = (True, fn(items[k]))
            except BaseException as err:  # handed to the caller, in order
                out = (False, err)
            with cond:
                results[k] = out
                cond.notify_all()

    threads = [threading.Thread(target=worker, daemon=True, name=f"generate-{n}") for n in range(concurrency)]
    for thread in threads:
        thread.start()
    try:
        while state["consumed"] < len(items):
            with cond:
                while state["consumed"] not in results:
                    cond.wait(timeout=0.5)  # wakes up for Ctrl-C
                ok, value = results.pop(state["consumed"])
                state["consumed"] += 1
                cond.notify_all()
            if not ok:
                raise value
            yield value
    finally:
        with cond:
            state["stop"] = True
            cond.notify_all()
