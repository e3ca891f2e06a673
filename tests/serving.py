"""Servers for the tests of ``draftsmith generate --server``: a real ``transformers serve`` of a local model, and a
scripted fake OpenAI-compatible server (standard library) for the failures a real one will not produce on demand."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

SERVE_START_S = 240.0  # importing torch, transformers and FastAPI on a busy 2-core machine takes a while


def free_port() -> int:
    """A TCP port nothing listens on now (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving_available() -> str | None:
    """None when ``transformers serve`` can run here, else the reason it cannot (its extra is not installed)."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
    if missing:
        return f"transformers serve needs {', '.join(missing)}: pip install 'transformers[serving]' (in the dev extra)"
    return None


class TransformersServe:
    """``transformers serve MODEL`` on ``127.0.0.1:port`` in a process of its own (one thread, CPU), stopped by
    :meth:`stop` (or as a context manager)."""

    def __init__(self, model: Path | str, port: int | None = None, log: Path | None = None) -> None:
        self.model, self.port = str(model), port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> TransformersServe:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"transformers serve already runs at {self.url}")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 -- kept open by the process
        cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", self.model]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + SERVE_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-2000:] if self.log and self.log.is_file() else ""
                raise RuntimeError(f"transformers serve exited with {self.proc.returncode}: {tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"transformers serve did not answer at {self.url} within {SERVE_START_S:.0f} s")

    def kill(self) -> None:
        """Ends the server at once (SIGKILL), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> TransformersServe:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def require_serving() -> None:
    reason = serving_available()
    if reason:
        pytest.skip(reason)


# ---------------------------------------------------------------------------------------------------------------------
# A scripted fake server.


class FakeServer:
    """An OpenAI-compatible server answering from a script, on a free localhost port (a thread).

    ``reply(body, n)`` returns the answer to the ``n``-th POST (0-based, counted over both endpoints): a dict is sent
    as JSON with status 200; ``(status, dict, headers)`` sends that status. The default answers the chat or
    completion the OpenAI way: ``"<last content>|<messages>"`` (chat) or ``"+<prompt>"`` (completion), cut by length
    when ``max_tokens`` < 4. With ``key``, a request without ``Authorization: Bearer <key>`` gets HTTP 401.
    ``requests`` records every POST body.
    """

    def __init__(
        self, models: list[str], reply: Callable[[dict[str, Any], int], Any] | None = None, key: str | None = None
    ) -> None:
        self.models, self.reply, self.key = models, reply or self.default_reply, key
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def send(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def refused(self) -> bool:
                if fake.key is not None and self.headers.get("Authorization") != f"Bearer {fake.key}":
                    self.send(401, {"error": {"message": "Invalid API key", "code": 401}})
                    return True
                return False

            def do_GET(self) -> None:
                if self.refused():
                    return
                if self.path == "/v1/models":
                    self.send(200, {"object": "list", "data": [{"id": m} for m in fake.models]})
                else:
                    self.send(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.refused():
                    return
                if self.path not in ("/v1/chat/completions", "/v1/completions"):
                    self.send(404, {"detail": "Not Found"})
                    return
                with fake.lock:
                    n = len(fake.requests)
                    fake.requests.append(body)
                answer = fake.reply(body, n)
                if isinstance(answer, tuple):
                    self.send(*answer)
                else:
                    self.send(200, answer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def default_reply(self, body: dict[str, Any], n: int) -> dict[str, Any]:
        cut = body.get("max_tokens", 99) < 4
        model = body.get("model", self.models[0])
        if "messages" in body:
            text = f"{body['messages'][-1]['content'][:12]}|{len(body['messages'])}"
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            text = "+" + body["prompt"][:6]
            choice = {"index": 0, "text": text}
        choice["finish_reason"] = "length" if cut else "stop"
        return {"model": model, "choices": [choice], "usage": {"completion_tokens": len(text)}}

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
