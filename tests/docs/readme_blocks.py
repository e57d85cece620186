"""README.md's fenced blocks as tests run them (pure: parsing, the reduced-scale rewrites and the
output comparison; ``test_readme.py`` runs them).

A block's shell commands are its lines joined at trailing backslashes; the whole-line ``#``
comments that follow a command show its output. In Python blocks the output is shown by
whole-line comments and by the comment on a ``print(`` line (``\\n`` for a line break); other
comments describe. Shown output is compared with ``…`` matching anything and whitespace ignored
(a comment wraps long output at word or JSON boundaries).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # of the opening fence, 1-based

    @property
    def name(self) -> str:
        return f"README.md:{self.line}"

    @property
    def opening(self) -> str:
        """The first line: what names a block where line numbers move."""
        return self.text.splitlines()[0]


@dataclass(frozen=True)
class Command:
    text: str  # one shell command: continuation lines joined, comments dropped, quoted as shlex does
    shown: str  # the output the README shows for it ("" for none)

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)


_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(text: str | None = None) -> list[Block]:
    text = README.read_text() if text is None else text
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in _FENCE.finditer(text)]


def commands(block: Block) -> list[Command]:
    """The block's commands, as a shell reads them: a line ending in a backslash, or inside an
    open quote, goes on in the next."""
    out: list[Command] = []
    pending = ""
    for raw in block.text.splitlines():
        line = raw.strip()
        if not pending and line.startswith("#"):  # output shown for the command above
            if not out:
                raise ValueError(f"{block.name}: a comment before any command: {line!r}")
            out[-1] = Command(out[-1].text, f"{out[-1].shown} {line[1:]}".strip())
            continue
        if not pending and not line:
            continue
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        out.append(Command(shlex.join(argv), ""))
        pending = ""
    if pending:
        raise ValueError(f"{block.name}: the last command does not end: {pending!r}")
    return out


def python_shown(source: str) -> str:
    """The output a Python block shows, in order."""
    parts = []
    for line in source.splitlines():
        if line.startswith("#"):
            parts.append(line[1:])
        elif m := re.match(r"\s*print\(.*\)\s+# ?(.*)$", line):
            parts.append(m.group(1).replace("\\n", " "))
    return " ".join(parts)


def matches(shown: str, actual: str) -> bool:
    """``actual`` is what ``shown`` shows: ``…`` stands for anything, whitespace is ignored."""
    squashed = [re.sub(r"\s+", "", part) for part in shown.split("…")]
    return re.fullmatch(".*?".join(map(re.escape, squashed)), re.sub(r"\s+", "", actual), re.S) is not None


@dataclass(frozen=True)
class Rewrite:
    """A change a test makes to a README command or program before running it: ``pattern`` (a
    regular expression) is replaced by ``replacement`` with ``{name}`` filled from the test's
    context. Every rewrite must change some block (``unused``), so the table cannot go stale."""

    pattern: str
    replacement: str
    why: str


# Applied in order to every command and Python block.
REWRITES: tuple[Rewrite, ...] = (
    Rewrite(r"(localhost|127\.0\.0\.1):8000\b", "{http}", "the test's server listens on a free port"),
    Rewrite(r"(localhost|127\.0\.0\.1):50051\b", "{grpc}", "the test's server listens on a free port"),
    Rewrite(r"--backend pdserve-grpc\b", r"--backend pdserve-grpc --port {grpc_port}",
            "gRPC bench takes make serve's default port; the test's server is elsewhere"),
    Rewrite(r"\.\./shared/data/", "{shared}/data/",
            "the data sits beside the repository; the tests run in a temporary directory"),
    Rewrite(r"^\.venv/bin/pdserve\b", "pdserve", "the test's own environment's pdserve"),
    Rewrite(r"--num-prompts \d+", "--num-prompts 2", "reduced scale"),
    Rewrite(r"--request-rate 0\.\d+", "--request-rate 1",
            "2 prompts at a CPU server's rate are seconds of idling; 2 at 1/s are no overload"),
    Rewrite(r"--dataset-name trace\b", "--dataset-name trace --trace-start 3",
            "the trace rows with the shortest prompts and outputs at 2 prompts"),
    Rewrite(r"^pdserve bench \.\.\.", "pdserve bench --base-url http://{http} --num-prompts 2 "
            "--random-input-len 64 --random-output-len 4 "
            "--sweep-max-doublings 0 --sweep-steps 0 --sweep-seeds 1",
            "the block's '...': the first command's server at reduced scale, one sweep point"),
    Rewrite(r"--duration 86400", "--duration 600", "reduced scale: 10 minutes of the day"),
    Rewrite(r"--gpus 64", "--gpus 4 --num-prompts 60 --jobs 1 --max-splits 3 --no-refine "
            "--colocated-budgets 2048 --priority-budgets '' --prefill-budgets 2048 --sweep-steps 1",
            "reduced scale: a small layout, one chunk budget"),
    Rewrite(r"^(pdserve profile .*)$",
            r"\1 --prefill-lens 16,64 --decode-batches 1,2 --decode-contexts 64 --repeat 1 --decode-steps 2",
            "reduced scale: a small grid"),
    Rewrite(r"--max-num-batched-tokens 512 \.\.\.$", "--max-num-batched-tokens 512 --num-prompts 20 "
            "--random-input-len 64 --random-output-len 8 --request-rate 5",
            "the block's '...': a small workload"),
    Rewrite(r"--model bench\b", "--model tiny", "the bench preset: 100M random weights, minutes on 2 cores"),
    Rewrite(r"/path/to/hf-llama-dir", "{tiny_dir}", "a Hugging Face directory: the tiny preset's"),
    Rewrite(r"/path/to/model\.Q4_K_M\.gguf", "{gguf}", "a GGUF file: SmolLM2's"),
    Rewrite(r"^(pdserve serve --prefill 2 --decode 2 .*)$",
            r"\1 --model tiny --local --http-port {http_port} --grpc-port {grpc_port}",
            "reduced scale: the tiny model, workers in-process, free ports"),
    Rewrite(r'prefill\.layer_ready\("req-1", i\)',
            'for i in range(decode_cache.shape[0]): prefill.layer_ready("req-1", i)',
            "the README shows the call for one layer; every layer must be ready"),
)  # fmt: skip


def rewrite(text: str, context: Mapping[str, str], used: set[int] | None = None) -> str:
    """``text`` through every rewrite in turn; ``context`` is read only for those that match."""
    for i, r in enumerate(REWRITES):
        if re.search(r.pattern, text, flags=re.M):
            text = re.sub(r.pattern, r.replacement.format_map(context), text, flags=re.M)
            if used is not None:
                used.add(i)
    return text


def unused(texts: Sequence[str], context: Mapping[str, str]) -> list[Rewrite]:
    used: set[int] = set()
    for t in texts:
        rewrite(t, context, used)
    return [r for i, r in enumerate(REWRITES) if i not in used]
