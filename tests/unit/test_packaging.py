"""The wheel installs one import name, ``pdserve``, holding every room of the repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOMS = (
    "model_runtime",
    "router",
    "worker",
    "prefill_worker",
    "decode_worker",
    "kvtransfer",
    "deploy",
    "simulator",
    "planning",
    "steptime",
)


def test_the_wheel_has_one_top_level_name_and_every_module(tmp_path: Path) -> None:
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    src = tmp_path / "src"
    junk = shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", "results"
    )
    shutil.copytree(ROOT, src, symlinks=True, ignore=junk)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
         str(src)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("pdserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert top == {"pdserve"}
    tracked = subprocess.run(
        ["git", "ls-files", *(f"{room}/*.py" for room in ROOMS)], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    if tracked:  # a source checkout: every module of every room is in the wheel, under pdserve
        assert {f"pdserve/{f}" for f in tracked} <= set(names)


def test_rooms_are_links_into_one_package() -> None:
    """``pdserve/<room>`` points at the top-level folder: one file, one module name."""
    for room in ROOMS:
        link = ROOT / "pdserve" / room
        assert link.is_symlink() and link.resolve() == (ROOT / room).resolve(), room


def test_a_bare_room_name_is_not_what_the_code_imports() -> None:
    import pdserve.router.service as service

    assert service.__name__ == "pdserve.router.service"
    assert not any(name.split(".", 1)[0] in ROOMS for name in sys.modules), "a room imported by its bare name"
