"""mypy --strict covers every module of the package and every benchmark script: a new module is
checked without anyone listing it, and a module leaves the check only by a named, reasoned
override."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
# The only modules whose type errors are not reported; pyproject.toml says why for each.
UNCHECKED = {
    "pdserve.model_runtime.kernels.paged_attention",  # Triton's language
    "pdserve.model_runtime.kernels.fused",  # Triton's language
    "pdserve.v1.*",  # protoc's output
}


def _mypy_config() -> dict[str, Any]:
    config: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    return config


def _modules() -> list[Path]:
    """Every .py of the package (through the rooms' links) and of benchmarks/, relative to the
    repository."""
    found = []
    for top in ("pdserve", "benchmarks"):
        for dirpath, dirnames, filenames in os.walk(ROOT / top, followlinks=True):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            found += [Path(dirpath, f).relative_to(ROOT) for f in filenames if f.endswith(".py")]
    return found


def test_mypy_checks_every_module() -> None:
    config = _mypy_config()
    assert config["strict"] is True
    assert "exclude" not in config, "an exclude pattern takes modules out of the check"
    roots = [Path(f) for f in config["files"]]
    modules = _modules()
    assert any(m.parts[:2] == ("pdserve", "router") for m in modules), "the rooms' links were not followed"
    missed = [str(m) for m in modules if not any(m == r or r in m.parents for r in roots)]
    assert not missed, f"modules mypy does not check: {missed}"


def test_only_the_named_modules_are_exempt() -> None:
    exempt: set[str] = set()
    for override in _mypy_config().get("overrides", []):
        names = override["module"]
        names = [names] if isinstance(names, str) else names
        ours = [n for n in names if n == "pdserve" or n.startswith("pdserve.")]
        if ours:
            assert set(override) == {"module", "ignore_errors"}, f"a relaxed check for {ours}: {override}"
            exempt.update(ours)
    assert exempt == UNCHECKED
