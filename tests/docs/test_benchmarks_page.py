"""BENCHMARKS.md stays a results page a user reads in a minute (issue 57): short, one results
table per area, and every row naming the command, commit and date of its number, so a reader
can re-run it; the history of each benchmark lives in ``docs/benchmarks/``, and every file the
page links there exists.

A results table is one whose header is ``HEADER``. A row whose value says it is not measured yet
carries "—" for its commit and date (nothing was measured, so nothing is dated); every other
row names at least one commit, which must exist where this checkout has the history to tell.
"""

from __future__ import annotations

import datetime
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "BENCHMARKS.md"
HISTORY = ROOT / "docs" / "benchmarks"
MAX_LINES = 500
HEADER = ("target", "latest measured", "command", "commit", "date")
NOT_MEASURED = ("not yet measured", "not measured")
NONE = "—"
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def cells(line: str) -> list[str]:
    """The cells of a Markdown table row (no cell of the page holds a ``|`` of its own)."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def sections(text: str) -> dict[str, list[str]]:
    """Each ``##`` section's lines, by its heading."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = out.setdefault(line[3:].strip(), [])
        elif current is not None:
            current.append(line)
    return out


def result_rows(lines: list[str]) -> list[list[str]]:
    """The rows of the results tables among ``lines``."""
    rows: list[list[str]] = []
    in_table = False
    for line in lines:
        if not line.startswith("|"):
            in_table = False
        elif tuple(cells(line)) == HEADER:
            in_table = True
        elif in_table and not set(line) <= set("|-: "):
            rows.append(cells(line))
    return rows


TEXT = PAGE.read_text()
SECTIONS = sections(TEXT)
ROWS = [(name, row) for name, lines in SECTIONS.items() for row in result_rows(lines)]


def row_id(item: tuple[str, list[str]]) -> str:
    name, row = item
    return f"{name}: {row[0][:60]}"


def test_the_page_is_short() -> None:
    lines = TEXT.count("\n")
    assert lines < MAX_LINES, (
        f"BENCHMARKS.md has {lines} lines (at most {MAX_LINES - 1}): keep the latest numbers there and "
        "move the history to docs/benchmarks/"
    )


def test_every_section_is_a_results_table() -> None:
    assert SECTIONS, "BENCHMARKS.md has no ## sections"
    without = [name for name, lines in SECTIONS.items() if not result_rows(lines)]
    assert not without, f"sections without a results table ({' | '.join(HEADER)}): {without}"


@pytest.mark.parametrize("item", ROWS, ids=[row_id(r) for r in ROWS])
def test_every_row_names_its_command_commit_and_date(item: tuple[str, list[str]]) -> None:
    name, row = item
    assert len(row) == len(HEADER), f"{name}: a row of {len(row)} cells, not {len(HEADER)}: {row}"
    target, value, command, commit, date = row
    assert target, f"{name}: a row without its target"
    assert value, f"{name}: {target}: no value"
    assert "`" in command, f"{name}: {target}: no command (in backticks): {command!r}"
    if value.lower().startswith(NOT_MEASURED):
        assert (commit, date) == (NONE, NONE), f"{name}: {target}: not measured, yet dated {commit} {date}"
        return
    assert COMMIT.search(commit), f"{name}: {target}: no commit (7+ hex digits): {commit!r}"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), f"{name}: {target}: date {date!r} is not YYYY-MM-DD"
    datetime.date.fromisoformat(date)


def _history_available() -> bool:
    if shutil.which("git") is None:
        return False
    run = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True
    )
    return run.returncode == 0 and run.stdout.strip() == "false"


def _is_commit(name: str) -> bool:
    run = subprocess.run(["git", "cat-file", "-e", f"{name}^{{commit}}"], cwd=ROOT, capture_output=True)
    return run.returncode == 0


def test_the_commits_exist() -> None:
    if not _history_available():
        pytest.skip("no git, or a checkout without the whole history: commits cannot be looked up")
    commits = sorted({c for _, row in ROWS if len(row) == len(HEADER) for c in COMMIT.findall(row[3])})
    missing = [c for c in commits if not _is_commit(c)]
    assert not missing, f"commits named in BENCHMARKS.md that this repository does not have: {missing}"


def test_every_measured_section_links_its_history() -> None:
    unlinked = [
        name
        for name, lines in SECTIONS.items()
        if any(not row[1].lower().startswith(NOT_MEASURED) for row in result_rows(lines))
        and not any("docs/benchmarks/" in target for target in LINK.findall("\n".join(lines)))
    ]
    assert not unlinked, (
        f"sections with measurements and no link to their history in docs/benchmarks/: {unlinked}"
    )


def test_linked_files_exist() -> None:
    broken = [target for target in LINK.findall(TEXT) if "://" not in target and not (ROOT / target).exists()]
    for page in sorted(HISTORY.glob("*.md")):
        broken += [
            f"{page.name}: {target}"
            for target in LINK.findall(page.read_text())
            if "://" not in target and not (page.parent / target).exists()
        ]
    assert not broken, f"links to files that do not exist: {broken}"
