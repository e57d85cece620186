"""``pdserve bench`` against a fake OpenAI-compatible server (standard library, no Ray, no model):
which model it sends when none is given, its exit status, the failure summary, the result file."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from benchmarks.client import free_port
from pdserve.cli import main


@dataclass
class Fake:
    """What the fake serves and what it was sent. ``reject(n)`` answers the n-th completion
    (counted from 0) with ``(status, message)`` instead of a stream."""

    models: list[str] = field(default_factory=lambda: ["smollm2-135m"])
    reject: Any = None
    sent_models: list[str] = field(default_factory=list)
    models_asked: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _handler(fake: Fake) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _json(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path != "/v1/models":
                self._json(404, {"detail": "Not Found"})
                return
            with fake.lock:
                fake.models_asked += 1
            self._json(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in fake.models]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            with fake.lock:
                n = len(fake.sent_models)
                fake.sent_models.append(body["model"])
            refused = fake.reject(n) if fake.reject else None
            if refused is None and body["model"] not in fake.models:
                refused = (400, f"model: {body['model']!r} is not served here")
            if refused is not None:
                status, message = refused
                self._json(status, {"error": {"message": message, "type": "x", "code": status}})
                return
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
            for i in range(body["max_tokens"]):
                chunk = {"choices": [{"index": 0, "text": f"t{i}"}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    return Handler


@pytest.fixture
def fake() -> Iterator[tuple[Fake, int]]:
    state = Fake()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def bench(port: int, *extra: str) -> int:
    return main(["bench", "--port", str(port), "--random-input-len", "8", "--random-output-len", "3",
                 "--num-prompts", "6", "--disable-tqdm", *extra])  # fmt: skip


def test_without_model_bench_sends_the_one_the_server_lists(fake: tuple[Fake, int], tmp_path: Path) -> None:
    state, port = fake
    save = ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    assert bench(port, *save) == 0
    assert state.models_asked == 1 and state.sent_models == ["smollm2-135m"] * 6
    m = json.loads((tmp_path / "r.json").read_text())
    assert m["completed"] == 6 and m["model_id"] == "smollm2-135m" and m["failure_causes"] == {}


def test_several_models_need_a_choice(fake: tuple[Fake, int], capsys: pytest.CaptureFixture[str]) -> None:
    state, port = fake
    state.models = ["a", "b"]
    assert bench(port) == 2
    err = capsys.readouterr().err
    assert f"GET http://127.0.0.1:{port}/v1/models lists 2 models (a, b): choose one with --model" in err
    assert state.sent_models == []  # nothing sent
    assert bench(port, "--model", "b") == 0
    assert state.sent_models == ["b"] * 6 and state.models_asked == 1  # --model: not asked


def test_a_run_where_nothing_succeeds_fails_with_the_causes_and_saves_nothing(
    fake: tuple[Fake, int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, port = fake
    save = ["--save-result", "--result-dir", str(tmp_path)]
    assert bench(port, "--model", "tiny", *save) == 1
    err = capsys.readouterr().err
    assert "6 of 6 requests failed:\n       6  HTTP 400: model: 'tiny' is not served here\n" in err
    assert "no request succeeded; no result saved" in err
    assert list(tmp_path.iterdir()) == []


def test_partial_failures_are_counted_by_cause_and_the_result_path_printed(
    fake: tuple[Fake, int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    state, port = fake
    # requests 0, 2, 4 refused as overloaded, 5 as too long; 1 and 3 served
    state.reject = lambda n: (429, "busy") if n % 2 == 0 else (400, "too long") if n == 5 else None
    monkeypatch.chdir(tmp_path)
    assert bench(port, "--max-concurrency", "1", "--save-result") == 0  # something was measured
    out, err = capsys.readouterr()
    assert "4 of 6 requests failed:\n       3  HTTP 429: busy\n       1  HTTP 400: too long\n" in err
    (saved,) = tmp_path.iterdir()
    assert f"saved {saved}\n" in out  # the absolute path: where the result went
    m = json.loads(saved.read_text())
    assert m["completed"] == 2 and m["rejected"] == 3
    assert m["failure_causes"] == {"HTTP 429: busy": 3, "HTTP 400: too long": 1}


def test_an_unreachable_server_is_an_error_naming_the_url(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    assert bench(port) == 1
    err = capsys.readouterr().err
    assert f"pdserve bench: error: GET http://127.0.0.1:{port}/v1/models: ConnectError" in err


def test_a_sweep_where_nothing_succeeds_fails(
    fake: tuple[Fake, int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, port = fake
    args = ["--model", "tiny", "--sweep", "--goodput", "ttft:1000", "--sweep-max-doublings", "1",
            "--sweep-steps", "0", "--sweep-seeds", "1", "--sweep-min-rate", "50",
            "--result-dir", str(tmp_path)]  # fmt: skip
    assert bench(port, *args) == 1
    assert "no request succeeded at any rate; no result saved" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_failure_causes_count_equal_errors_most_frequent_first() -> None:
    from pdserve.bench.metrics import failure_causes

    errors = ["", "HTTP 429: busy", "HTTP 400: x", "", "HTTP 429: busy", "HTTP 503: down", "HTTP 400: x"]
    assert failure_causes(errors) == [("HTTP 429: busy", 2), ("HTTP 400: x", 2), ("HTTP 503: down", 1)]
    assert failure_causes(["", ""]) == []
