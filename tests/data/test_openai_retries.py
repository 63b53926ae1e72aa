"""Answers from an OpenAI-compatible server that hiccups: a real HTTP server on 127.0.0.1 (in a
thread) fails the first requests with 503 or drops the connection, then answers. The answers
come back in order; a 4xx fails at once; a server that never recovers fails after the retry
budget with one line naming the URL."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from draftport.engines import openai
from draftport.errors import DraftportError

EOS = 2


class Flaky(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, failures: list[str]):
        """failures: what the first requests get, in order ("503", "429", "drop", "400"); the
        rest are answered: the prompt's ids + 100, then EOS."""
        super().__init__(("127.0.0.1", 0), Handler)
        self.failures, self.lock, self.seen = list(failures), threading.Lock(), 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.seen += 1
            fail = self.server.failures.pop(0) if self.server.failures else None
        if fail == "drop":  # no status line at all: the client sees the connection close
            self.close_connection = True
            return
        if fail is not None:
            self.send_error(int(fail), "busy" if fail != "400" else "bad request")
            return
        assert self.path == "/v1/completions" and body["temperature"] == 0.0 and body["return_token_ids"]
        out = json.dumps(
            {"choices": [{"token_ids": [t + 100 for t in body["prompt"]] + [EOS], "finish_reason": "stop"}]}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture
def serve(monkeypatch):
    monkeypatch.setattr(openai, "WAIT_FIRST_S", 0.05)
    monkeypatch.setattr(openai, "WAIT_MAX_S", 0.2)
    monkeypatch.setattr(openai, "WAIT_JITTER_S", 0.01)
    servers = []

    def start(failures):
        s = Flaky(failures)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


PROMPTS = [[i, i + 1, i + 2] for i in range(12)]


def test_answers_come_back_in_order_through_503s_and_dropped_connections(serve, capsys):
    s = serve(["503", "drop", "429", "503", "drop", "502"])
    out = openai.regenerate_openai(s.base, "m", PROMPTS, max_new_tokens=8, eos_id=EOS, concurrency=4, retry_s=30)
    assert out == [[t + 100 for t in p] + [EOS] for p in PROMPTS]
    assert s.seen == len(PROMPTS) + 6
    assert f"warning: {s.base}/completions:" in capsys.readouterr().err


def test_a_4xx_fails_at_once(serve):
    s = serve(["400"])
    t0 = time.monotonic()
    with pytest.raises(DraftportError) as e:
        openai.complete_ids(s.base, "m", [1, 2], max_new_tokens=4, eos_id=EOS, retry_s=30)
    assert time.monotonic() - t0 < 5 and s.seen == 1
    assert str(e.value).startswith(f"{s.base}/completions: HTTP 400")


def test_a_server_that_stays_down_fails_after_the_budget_naming_the_url(serve):
    s = serve(["503"] * 1000)
    t0 = time.monotonic()
    with pytest.raises(DraftportError) as e:
        openai.regenerate_openai(s.base, "m", PROMPTS[:2], max_new_tokens=4, eos_id=EOS, concurrency=1, retry_s=1.0)
    msg = str(e.value)
    assert 1.0 <= time.monotonic() - t0 < 10 and s.seen > 2
    assert msg.startswith(f"{s.base}/completions: HTTP 503") and "gave up after" in msg and "\n" not in msg


def test_a_refused_connection_is_retried_then_named(monkeypatch):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(openai, "WAIT_FIRST_S", 0.05)
    with pytest.raises(DraftportError, match=rf"^http://127.0.0.1:{port}/v1/completions: cannot reach the server"):
        openai.complete_ids(f"http://127.0.0.1:{port}/v1", "m", [1], max_new_tokens=1, eos_id=EOS, retry_s=0.5)
