"""Every router -> worker call is a typed message dispatched through a handler table
(``pdserve.worker.handlers``, ``pdserve.worker.control``): no method named by a string, no
``getattr`` dispatch. This walks the syntax tree of every Python file of the repository
(product, tools, benchmarks and tests) and fails on the three shapes that dispatch by name:

- ``x.call("load", ...)``: a ``call`` whose first argument is a string literal;
- ``getattr(x, name)(...)``: calling what ``getattr`` found under a computed name;
- ``getattr(x, ...).remote(...)``: a Ray method picked by name.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".venv", ".git", "node_modules", "build", "dist", "__pycache__", "v1"}  # v1: generated stubs


def _is_getattr(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"


def string_dispatch(source: str, filename: str = "<source>") -> list[str]:
    """Each dispatch by name in ``source``, as ``file:line: what``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        what = ""
        if isinstance(node, ast.Call):
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "call"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                what = f'.call("{node.args[0].value}") names a method by a string'
            elif _is_getattr(func):
                assert isinstance(func, ast.Call)
                name = func.args[1] if len(func.args) > 1 else None
                if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                    what = "getattr(obj, <computed name>)(...) dispatches by name"
        elif isinstance(node, ast.Attribute) and node.attr == "remote" and _is_getattr(node.value):
            what = "getattr(actor, ...).remote picks a Ray method by name"
        if what:
            found.append(f"{filename}:{node.lineno}: {what}")
    return found


def python_files(root: Path) -> list[Path]:
    """The repository's own Python files (each once: linked folders are not followed)."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("."))
        out += [Path(d) / f for f in sorted(files) if f.endswith(".py")]
    return out


@pytest.mark.parametrize(
    "code",
    [
        'async def f(w):\n    await w.call("switch_role", "prefill", timeout_s=1)\n',
        "def f(host, method, *args):\n    return getattr(host, method)(*args)\n",
        "def f(actor, method):\n    return getattr(actor, method).remote()\n",
        'def f(actor):\n    return getattr(actor, "info").remote()\n',
    ],
)
def test_each_shape_of_dispatch_by_name_is_found(code: str) -> None:
    assert len(string_dispatch(code)) == 1


@pytest.mark.parametrize(
    "code",
    [
        "def f(loop, fn):\n    return loop.call(fn, 1)\n",  # a function, not a name
        'def f(obj):\n    return getattr(obj, "model", None)\n',  # reading a field
        "async def f(w, msg):\n    return await w.control(msg, timeout_s=1)\n",
        "def f(actor, msg):\n    return actor.control.remote(msg)\n",
    ],
)
def test_typed_calls_and_plain_reads_pass(code: str) -> None:
    assert string_dispatch(code) == []


def test_nothing_in_the_repository_dispatches_by_name() -> None:
    files = python_files(ROOT)
    assert ROOT / "router" / "workers.py" in files and ROOT / "deploy" / "ray_pools.py" in files
    found = [hit for p in files for hit in string_dispatch(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "dispatch by name (send a typed message instead):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "path", ["prefill_worker/actor.py", "decode_worker/actor.py", "deploy/pool_worker.py"]
)
def test_role_hosts_restate_no_command(path: str) -> None:
    """A role is its engine and its handler table: its host class adds no method that restates
    a command (tests and tools send the command itself: ``WorkerHost.run``, ``control``)."""
    tree = ast.parse((ROOT / path).read_text())
    hosts = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    assert hosts
    for cls in hosts:
        methods = [f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        assert set(methods) <= {"__init__"}, f"{cls.name} restates commands as methods: {methods}"


def test_every_control_message_has_its_handler() -> None:
    """Adding a control message is one dataclass and one table entry: a message without its
    entry is caught here, not by a worker that refuses it."""
    from pdserve.worker import control

    messages = {
        v for v in vars(control).values() if isinstance(v, type) and issubclass(v, control.Control)
    } - {control.Control}
    assert messages and messages == set(control.CONTROL_HANDLERS)
