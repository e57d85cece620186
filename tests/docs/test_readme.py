"""Every fenced block of README.md runs, at reduced scale, so the README cannot drift from the
flags and outputs it shows (issue 56).

Each block is a test of its own (``README.md:<line>``): a new block is covered the day it is
written, or fails for want of a runner. Commands run as written but for ``REWRITES``
(``readme_blocks.py``: ports, data paths, smaller counts, each with its reason); the output a
block shows must be what it prints. The quickstart runs against one server started exactly as
``make serve`` starts it (the Makefile's own command line, SmolLM2-135M on a private Ray
instance), shared by every block that talks to a server. ``pdserve`` commands other than
``serve`` run in this process (the same ``main`` the console script calls) to spare each an
interpreter start.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from benchmarks.client import free_port, wait_ready
from pdserve.cli import build_parser, main
from pdserve.model_runtime.config import COMPUTE_MODES
from pdserve.model_runtime.presets import MODEL_NAMES
from tests.docs.readme_blocks import (
    REWRITES,
    ROOT,
    Block,
    Command,
    blocks,
    commands,
    matches,
    python_shown,
    rewrite,
    unused,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BLOCKS = blocks()
SHARED = ROOT.parent / "shared"
SERVER_KEYS = ("http", "grpc", "http_port", "grpc_port")

# Blocks no test runs, by their first line, each with the reason; every entry must still open a
# block. Each other block runs (grpcurl through its equivalent where it is not installed).
EXCEPTIONS: dict[str, str] = {}


def makefile_serve_args() -> list[str]:
    """The ``pdserve serve`` arguments ``make serve`` runs (the Makefile's recipe, as make prints it)."""
    out = subprocess.run(["make", "-n", "serve"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    m = re.search(r"/pdserve (serve [^;]*);", out)
    assert m, f"no pdserve serve in make serve's recipe:\n{out}"
    return shlex.split(m.group(1))


def _stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: drains and stops Ray with it
        try:
            out, _ = proc.communicate(timeout=90)
            return out
        except subprocess.TimeoutExpired:
            proc.kill()
    out, _ = proc.communicate()
    return out


@contextlib.contextmanager
def serving(args: list[str]) -> Iterator[tuple[subprocess.Popen[str], int, int]]:
    """``pdserve <args>`` on free ports until its health says ready; (process, HTTP, gRPC port)."""
    hp, gp = free_port(), free_port()
    cmd = [sys.executable, "-m", "pdserve", *args, "--http-port", str(hp), "--grpc-port", str(gp)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{hp}/health", proc, timeout_s=240)
        yield proc, hp, gp
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def server() -> Iterator[dict[str, str]]:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    args = makefile_serve_args()
    if args[args.index("--model") + 1] == "smollm2-135m":
        from pdserve.model_runtime.errors import ModelLoadError
        from pdserve.model_runtime.presets import INSTALLED

        try:
            INSTALLED["smollm2-135m"].path()
        except ModelLoadError as e:  # make serve would serve tiny: the README's answers are SmolLM2's
            pytest.skip(str(e))
    with serving(args) as (_, hp, gp):
        yield {
            "http": f"127.0.0.1:{hp}",
            "grpc": f"127.0.0.1:{gp}",
            "http_port": str(hp),
            "grpc_port": str(gp),
        }


class Context(dict[str, str]):
    """What rewrites fill in; the shared server starts only when a block asks for its address."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        from pdserve.model_runtime.presets import INSTALLED, resolve_model

        super().__init__(shared=str(SHARED), tiny_dir=str(resolve_model("tiny").path))
        self.request = request
        self.installed = INSTALLED

    def __missing__(self, key: str) -> str:
        if key == "gguf":
            self[key] = str(self.installed["smollm2-135m"].path())
        elif key in SERVER_KEYS:
            self.update(self.request.getfixturevalue("server"))
        return self[key]


# -- shell commands -----------------------------------------------------------------------------


def run_make(cmd: Command, ctx: Context) -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    (target,) = cmd.argv[1:]
    out = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    if target == "serve":  # the server of this module's quickstart runs exactly these flags
        build_parser().parse_args(makefile_serve_args())
    else:
        assert "-m pytest" in out.stdout


def run_curl(cmd: Command, ctx: Context) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    argv = shlex.split(rewrite(cmd.text, ctx))
    out = subprocess.run([*argv, "-w", "\n%{http_code}"], capture_output=True, text=True, timeout=120)
    body, _, code = out.stdout.rpartition("\n")
    assert out.returncode == 0 and code == "200", (cmd.text, out.stdout, out.stderr)
    assert not cmd.shown or matches(cmd.shown, body), f"the README shows\n{cmd.shown}\nit printed\n{body}"


def grpcurl_equivalent(argv: list[str]) -> str:
    """What ``grpcurl -plaintext [-d JSON] ADDRESS (list | SERVICE/METHOD)`` does, through the
    server's reflection as grpcurl does: the JSON is parsed against the method's input message
    (an unknown field is an error, as in grpcurl), and the call must succeed."""
    from google.protobuf import json_format, message_factory
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    args = argv[1:]
    assert args.pop(0) == "-plaintext"
    data = "{}"
    if args[0] == "-d":
        data = args[1]
        args = args[2:]
    address, verb = args
    with grpc.insecure_channel(address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        if verb == "list":
            return "\n".join(db.get_services())
        service, method = verb.rsplit("/", 1)
        desc = DescriptorPool(db).FindServiceByName(service).FindMethodByName(method)
        req_cls = message_factory.GetMessageClass(desc.input_type)
        resp_cls = message_factory.GetMessageClass(desc.output_type)
        request = json_format.Parse(data, req_cls())
        call = channel.unary_stream if desc.server_streaming else channel.unary_unary
        rpc = call(f"/{verb}", request_serializer=req_cls.SerializeToString,
                   response_deserializer=resp_cls.FromString)  # fmt: skip
        responses = list(rpc(request, timeout=60)) if desc.server_streaming else [rpc(request, timeout=60)]
        return "\n".join(json_format.MessageToJson(r) for r in responses)


def run_grpcurl(cmd: Command, ctx: Context) -> None:
    argv = shlex.split(rewrite(cmd.text, ctx))
    if shutil.which("grpcurl"):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (cmd.text, out.stderr)
        text = out.stdout
    else:  # no grpcurl package for this system: the same request through the same reflection
        text = grpcurl_equivalent(argv)
    assert text.strip(), cmd.text
    assert not cmd.shown or matches(cmd.shown, text), f"the README shows\n{cmd.shown}\nit printed\n{text}"
    if argv[-1] == "list":
        assert "pdserve.v1.Inference" in text.split()
    elif argv[-1].endswith("Health/Check"):
        assert '"SERVING"' in text
    elif argv[-1].endswith("/Generate"):
        assert '"finishReason"' in text


def run_pdserve(cmd: Command, ctx: Context) -> None:
    argv = shlex.split(rewrite(cmd.text, ctx))
    assert argv[0] == "pdserve", cmd.text
    if argv[1] == "serve":
        run_serve(argv[1:])
        return
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv[1:])
        except SystemExit as e:  # argparse refused a flag
            rc = e.code
    assert rc == 0, f"{shlex.join(argv)}: exit {rc}\n{out.getvalue()[-3000:]}\n{err.getvalue()[-3000:]}"
    assert not cmd.shown or matches(cmd.shown, out.getvalue())
    if argv[1] == "bench" and "--sweep" not in argv:  # every request of the README's examples completes
        assert re.search(r"^Failed requests:\s+0\s*$", out.getvalue(), re.M), out.getvalue()
        assert not err.getvalue().count("requests failed"), err.getvalue()
    if "--save-result" in argv:
        saved = re.findall(r"^saved (\S+)$", out.getvalue(), re.M)
        assert saved and all(Path(p).is_file() for p in saved), out.getvalue()


def run_serve(args: list[str]) -> None:
    """A ``pdserve serve`` example: it starts, serves a request in each SLO class it defines
    (an unknown class is refused), and drains and stops on Ctrl-C."""
    pos = [i for i, a in enumerate(args) if a in ("--http-port", "--grpc-port")]
    base = [a for i, a in enumerate(args) if i not in pos and i - 1 not in pos]  # ports: serving's own
    with serving(base) as (proc, hp, _):
        model = httpx.get(f"http://127.0.0.1:{hp}/v1/models", timeout=30).json()["data"][0]["id"]
        classes = [a.split(":", 1)[0] for a, flag in zip(args[1:], args, strict=False) if flag == "--slo"]
        for cls in [*classes, "no-such-class"]:
            body = {"model": model, "prompt": "Hello", "max_tokens": 2, "slo_class": cls}
            r = httpx.post(f"http://127.0.0.1:{hp}/v1/completions", json=body, timeout=60)
            assert r.status_code == (400 if cls == "no-such-class" else 200), (cls, r.text)
        out = _stop(proc)
    assert proc.returncode == 0 and "pdserve: stopped" in out, out[-3000:]


SHELL: dict[str, Callable[[Command, Context], None]] = {
    "make": run_make,
    "curl": run_curl,
    "grpcurl": run_grpcurl,
    "pdserve": run_pdserve,
    ".venv/bin/pdserve": run_pdserve,
}


def run_shell(block: Block, ctx: Context) -> None:
    for cmd in commands(block):
        program = cmd.argv[0]
        assert program in SHELL, f"{block.name}: no runner for {program!r}: add one to SHELL or to EXCEPTIONS"
        SHELL[program](cmd, ctx)


# -- the serve synopsis -------------------------------------------------------------------------


def run_synopsis(block: Block, ctx: Context) -> None:
    """``pdserve serve [--flag VALUE] ...``: every flag of the parser is listed and every listed
    one exists; a listed ``a|b|c`` is the flag's choices (a path or placeholder may follow them);
    a listed literal value is the flag's default."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = commands.choices["serve"]
    actions = {s: a for a in parser._actions for s in a.option_strings if s.startswith("--")}
    listed = dict(re.findall(r"\[(--[\w-]+)(?: ([^\]\[\s]+))?", block.text))
    listed.update(re.findall(r"(--tls-(?:cert|key)) (PEM)", block.text))
    assert set(actions) - {"--help"} - set(listed) == set(), "flags of pdserve serve the README does not list"
    assert set(listed) - set(actions) == set(), "flags the README lists that pdserve serve does not take"
    for flag, value in listed.items():
        action = actions[flag]
        literal = [v for v in value.split("|") if v and not re.search(r"[A-Z]|^/", v)]  # not PATH, N
        if "|" in value:
            choices = action.choices or {"--model": MODEL_NAMES, "--compute": COMPUTE_MODES}.get(flag)
            assert choices is None or set(literal) <= set(map(str, choices)), (flag, literal, choices)
        elif literal:
            default = action.default
            assert (float(value) if isinstance(default, float) else value) == (
                default if isinstance(default, float) else str(default)
            ), (flag, value, default)


# -- Python blocks ------------------------------------------------------------------------------


def run_python(block: Block, ctx: Context, prelude: str = "") -> dict[str, Any]:
    source = rewrite(block.text, ctx)
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(prelude + source, block.name, "exec"), namespace)
    shown = python_shown(block.text)
    assert matches(shown, out.getvalue()), f"the README shows\n{shown}\nit printed\n{out.getvalue()}"
    return namespace


KV_PRELUDE = """
from tests.kvtransfer.helpers import SECRET as secret, cache
decode_cache, _ = cache()
prefill_cache, _ = cache(seed=1)
src_blocks, dst_blocks = [3, 9, 4], [0, 7, 20]
"""


def run_kv(block: Block, ctx: Context) -> None:
    """The KV transport example, given caches and blocks: the blocks arrive, byte for byte."""
    from pdserve.kvtransfer.states import TransferState
    from tests.kvtransfer.helpers import same_bytes

    ns = run_python(block, ctx, KV_PRELUDE)
    decode, prefill = ns["decode"], ns["prefill"]
    try:
        deadline = time.monotonic() + 30
        while decode.state("req-1") is not TransferState.DONE:
            assert time.monotonic() < deadline, decode.state("req-1")
            time.sleep(0.01)
        assert same_bytes(ns["prefill_cache"], ns["src_blocks"], ns["decode_cache"], ns["dst_blocks"])
    finally:
        prefill.close()
        decode.close()


PYTHON: dict[str, Callable[[Block, Context], Any]] = {
    "from openai import OpenAI": run_python,
    "import grpc": run_python,
    "from pydantic import BaseModel": run_python,  # (an exception until the workers mask: see above)
    "from pdserve.decode_worker.offline import OfflineDriver": run_python,
    "from pdserve.kvtransfer.config import TransportConfig": run_kv,
}


def runner(block: Block) -> Callable[[Block, Context], Any]:
    if block.lang == "python":
        assert block.opening in PYTHON, f"{block.name}: no runner for Python opening {block.opening!r}"
        return PYTHON[block.opening]
    assert block.lang == "bash", f"{block.name}: no runner for a {block.lang!r} block"
    return run_synopsis if block.text.startswith("pdserve serve [") else run_shell


# -- the tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_readme_block(
    block: Block, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if block.opening in EXCEPTIONS:
        pytest.skip(EXCEPTIONS[block.opening])
    if "shared/data/" in block.text and not SHARED.joinpath("data").is_dir():
        pytest.skip(f"{SHARED}/data is not beside the repository")
    monkeypatch.chdir(tmp_path)  # results, plots and profiles are written here
    runner(block)(block, Context(request))


def test_every_block_has_a_runner_and_every_exception_a_block() -> None:
    openings = {b.opening for b in BLOCKS}
    assert set(EXCEPTIONS) <= openings, f"exceptions that open no block: {set(EXCEPTIONS) - openings}"
    for block in BLOCKS:
        if block.opening not in EXCEPTIONS and runner(block) is run_shell:
            for cmd in commands(block):
                assert cmd.argv[0] in SHELL, f"{block.name}: no runner for {cmd.argv[0]!r}"


def test_every_rewrite_changes_a_block() -> None:
    context = {k: "x" for k in ("shared", "tiny_dir", "gguf", *SERVER_KEYS)}
    texts = [c.text for b in BLOCKS if runner(b) is run_shell for c in commands(b)]
    texts += [b.text for b in BLOCKS if b.lang == "python"]
    assert unused(texts, context) == [], "rewrites that no longer match the README: drop them"
    assert len(REWRITES) == len({r.pattern for r in REWRITES})


def test_shown_output_is_compared_with_wildcards_and_without_whitespace() -> None:
    assert matches('{"id":"chatcmpl-…","n":1,…}', '{"id":"chatcmpl-9f2", "n": 1, "x": 2}')
    assert not matches('{"n":1}', '{"n":12}')
    assert not matches("Paris", "Paris is the capital")  # the whole output, unless … says more follows
    assert matches("Paris …", "Paris is the capital")
