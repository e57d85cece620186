"""Rooms import downward only. Each room, and the shared pieces under ``pdserve/`` that rooms
use (``flags``, ``bench``), may import the rooms listed for it and nothing else: no cycle, no
upward arrow, so a room can be read (and tested) with only what lies below it. The check is
static, over every import statement, those inside functions and ``TYPE_CHECKING`` blocks
included, except where ``TYPE_CHECKING_ONLY`` names it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_RUNTIME = {"model_runtime", "steptime"}
_WORKERS = _RUNTIME | {"kvtransfer", "worker", "prefill_worker", "decode_worker"}
ALLOWED: dict[str, set[str]] = {
    "steptime": set(),
    "model_runtime": {"steptime"},
    "kvtransfer": {"model_runtime"},
    "worker": {"model_runtime", "kvtransfer"},
    "prefill_worker": {"model_runtime", "kvtransfer", "worker"},
    "decode_worker": {"model_runtime", "kvtransfer", "worker"},
    "router": _RUNTIME | {"kvtransfer", "worker", "v1"},
    "flags": {"steptime", "model_runtime", "router"},
    "bench": {"flags", "v1"},
    "deploy": _WORKERS | {"router"},
    "simulator": _WORKERS | {"router", "flags", "bench"},
    # how many workers of which role: decides on top of the simulator, drives a deployment
    "planning": _WORKERS | {"router", "flags", "bench", "simulator", "deploy"},
}
# The live autoscaler acts on a ``Service``, which it is handed: deploy never imports planning.
TYPE_CHECKING_ONLY = {("planning", "deploy")}


def _room_folder(room: str) -> Path:
    return ROOT / "pdserve" / room if room in {"flags", "bench"} else ROOT / room


def _imports(path: Path) -> list[tuple[str, bool]]:
    """``(room, under TYPE_CHECKING)`` for each ``pdserve.<room>`` a module imports."""
    tree = ast.parse(path.read_text(), str(path))
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "pdserve" and len(parts) > 1:
                found.append((parts[1], id(node) in guarded))
    return found


def test_every_room_imports_only_the_rooms_below_it() -> None:
    wrong = []
    for room, allowed in ALLOWED.items():
        folder = _room_folder(room)
        files = [folder.with_suffix(".py")] if not folder.is_dir() else sorted(folder.rglob("*.py"))
        for path in files:
            for target, typing_only in _imports(path):
                if target == room or target in allowed:
                    continue
                if not (typing_only and (room, target) in TYPE_CHECKING_ONLY):
                    wrong.append(f"{path.relative_to(ROOT)} imports pdserve.{target}")
    assert not wrong, "\n".join(wrong)


def test_the_table_knows_every_room() -> None:
    links = {p.name for p in (ROOT / "pdserve").iterdir() if p.is_symlink()}
    assert links <= set(ALLOWED), sorted(links - set(ALLOWED))


def test_a_room_importing_upward_is_caught(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nimport pdserve.planning.planner\n"
        "if TYPE_CHECKING:\n    from pdserve.deploy.service import Service\n"
        "def f():\n    from pdserve.simulator import run\n"
    )
    assert _imports(module) == [("planning", False), ("deploy", True), ("simulator", False)]
