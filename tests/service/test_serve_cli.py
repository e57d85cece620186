"""``pdserve serve`` as a user runs it: a subprocess on a private Ray instance, drained by SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from benchmarks.client import free_port, wait_ready
from pdserve.v1 import inference_pb2_grpc as pb_grpc
from tests.service.helpers import grpc_request

pytestmark = pytest.mark.slow


def _serve_tiny() -> tuple[subprocess.Popen[str], int, int]:
    """``pdserve serve --model tiny`` on free ports, ready; (process, HTTP port, gRPC port)."""
    hp, gp = free_port(), free_port()
    exe = str(Path(sys.executable).with_name("pdserve"))
    cmd = [exe, "serve", "--model", "tiny", "--http-port", str(hp), "--grpc-port", str(gp)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{hp}/health", proc, timeout_s=120)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, hp, gp


def test_sigterm_drains_in_flight_requests_then_exits_cleanly() -> None:
    proc, hp, gp = _serve_tiny()
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{gp}"))
        # 500 tokens: seconds of decoding on this CPU, far longer than the drain's checks below
        call = stub.Generate(grpc_request(list(range(3, 40)), 500, stream=True))
        next(call)
        result: dict[str, Any] = {}

        def finish() -> None:
            try:
                result["msgs"] = list(call)
            except grpc.RpcError as e:
                result["error"] = e

        reader = threading.Thread(target=finish)
        reader.start()
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(f"http://127.0.0.1:{hp}/health", timeout=2).status_code != 503:
            assert time.monotonic() < deadline, "health never turned unavailable while draining"
            time.sleep(0.05)
        r = httpx.post(
            f"http://127.0.0.1:{hp}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}
        )
        assert r.status_code == 503  # no new work while draining
        reader.join(60)
        assert "error" not in result, result.get("error")
        assert sum(len(m.chunk.token_ids) for m in result["msgs"]) == 499  # the first came before
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "draining 1 in-flight requests" in out and "pdserve: stopped" in out
        # no gRPC server of ours runs while Ray forks its processes at start-up
        assert "skipping fork() handlers" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


FAULTS = ["unsupported_architecture", "missing_weights", "bad_config", "corrupt_weights"]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_model_that_cannot_load_ends_serve_with_its_own_message(fault: str, tmp_path: Path) -> None:
    """A model that cannot load makes ``pdserve serve`` print the error and exit non-zero at
    once, with Ray shut down: no hang, no bare traceback. What the router can see (config, files)
    fails before any worker starts; a corrupt weight file fails in the workers' own Ray actors."""
    import json
    import shutil

    from pdserve.model_runtime.presets import resolve_model

    model = tmp_path / "model"
    shutil.copytree(resolve_model("tiny").path, model)
    config = json.loads((model / "config.json").read_text())
    if fault == "unsupported_architecture":
        config["architectures"] = ["GPT2LMHeadModel"]
        expected = "unsupported architecture 'GPT2LMHeadModel'"
    elif fault == "missing_weights":
        (model / "model.safetensors").unlink()
        expected = "no *.safetensors weight files"
    elif fault == "bad_config":
        config["num_attention_heads"] = 0
        expected = "num_attention_heads must be a positive integer, got 0"
    else:
        (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
        expected = "corrupt or unreadable safetensors file"
    (model / "config.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", str(model),
           "--http-port", str(free_port()), "--grpc-port", str(free_port())]  # fmt: skip
    # Timed from when the workers can start: once Ray is up, or from the start where the
    # router's own check refuses the model before Ray starts.
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    stderr = []
    for line in proc.stderr:
        stderr.append(line)
        if "Started a local Ray instance" in line:
            t0 = time.monotonic()
    proc.wait(timeout=120)
    took = time.monotonic() - t0
    errors = [line for line in stderr if line.startswith("pdserve: error:")]
    assert proc.returncode != 0 and errors, "".join(stderr)[-3000:]
    assert "did not start" in errors[0] and expected in errors[0], errors
    assert "Traceback" not in "".join(stderr).split("pdserve: error:")[-1]  # the message is the end of it
    ray_started = any("Started a local Ray instance" in line for line in stderr)
    assert ray_started == (fault == "corrupt_weights"), "only weights the router cannot see reach the workers"
    assert took < 30, took  # the alternative is the 300 s start-up deadline


def _children(proc: subprocess.Popen[str]) -> list[Any]:
    import psutil

    return list(psutil.Process(proc.pid).children(recursive=True))


def _assert_gone(processes: list[Any], timeout_s: float = 15) -> None:
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    assert not alive, [(p.pid, p.name()) for p in alive]


def test_a_second_signal_stops_at_once_and_leaves_nothing_behind() -> None:
    """Users press Ctrl-C twice: the second cuts the drain short (in-flight requests aborted)
    and the shutdown still completes: no KeyboardInterrupt halfway, no worker or Ray process
    left running."""
    proc, hp, gp = _serve_tiny()
    try:
        children = _children(proc)
        assert children, "Ray and the workers run as children of pdserve serve"
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{gp}"))
        call = stub.Generate(grpc_request(list(range(3, 40)), 2000, stream=True))
        next(call)
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        while httpx.get(f"http://127.0.0.1:{hp}/health", timeout=2).status_code != 503:
            assert time.monotonic() < deadline, "health never turned unavailable while draining"
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGTERM)  # a third: ignored, the shutdown is under way
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
        assert proc.returncode == 1, out
        assert "second stop signal" in out, out
        assert "pdserve: stopped (some requests were aborted)" in out
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
        assert took < 15, took
        with pytest.raises(grpc.RpcError):
            list(call)  # aborted, not left hanging
        _assert_gone(children)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_signal_during_start_up_stops_cleanly() -> None:
    exe = str(Path(sys.executable).with_name("pdserve"))
    cmd = [exe, "serve", "--model", "tiny", "--prefill", "2", "--decode", "2",
           "--http-port", str(free_port()), "--grpc-port", str(free_port())]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Started a local Ray instance" in line:
                break
        children = _children(proc)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        out = "".join(lines) + out
        assert proc.returncode == 1, out
        assert "stopping before the deployment was ready" in out and "pdserve: stopped" in out, out
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
        _assert_gone(children)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stop_signalled_to_every_process_ends_pdserve_in_seconds() -> None:
    """As systemd's default ``KillMode=control-group`` does: SIGTERM to every process of the
    session, Ray's GCS and raylet included. pdserve notices its Ray is gone within seconds, says
    so, stops what is left and exits (it used to hang for a minute, then abort), leaving no
    process of its session behind."""
    import psutil

    hp, gp = free_port(), free_port()
    exe = str(Path(sys.executable).with_name("pdserve"))
    cmd = [exe, "serve", "--model", "tiny", "--http-port", str(hp), "--grpc-port", str(gp)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )

    def session() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if os.getsid(p.pid) == proc.pid:
                    found.append(p)
        return found

    try:
        wait_ready(f"http://127.0.0.1:{hp}/health", proc, timeout_s=120)
        members = session()
        assert {"gcs_server", "raylet"} <= {p.name() for p in members}
        t0 = time.monotonic()
        for p in members:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took < 20, (took, out[-3000:])
    assert proc.returncode == 1 and "is gone" in out and "KillMode=mixed" in out, out[-3000:]
    time.sleep(1.0)
    assert not [p for p in session() if p.status() != psutil.STATUS_ZOMBIE], out[-3000:]
