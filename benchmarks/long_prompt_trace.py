"""A long-prompt, multi-turn trace in Mooncake's JSONL format, deterministic by seed.

    .venv/bin/python -m benchmarks.long_prompt_trace --out /tmp/long_prompt.jsonl
    .venv/bin/pdserve plan --gpus 64 --trace /tmp/long_prompt.jsonl --goodput ttft:2000 tpot:100

Lengths follow the public Mooncake FAST'25 conversation trace (kvcache-ai/Mooncake,
``FAST25-release/traces/conversation_trace.jsonl``; its README: 12,031 requests from one hour of
Kimi's online traffic, mean input 12,035 tokens, mean output 343, 512-token hash blocks). The
quantile tables below were computed from that file; lengths are drawn from them (inverse CDF,
log-linear between the points).

Conversations as the published trace shows them: every published row starts with the same
512-token block (hash id 0, a shared system prompt), and rows sharing their second block come
in runs of 1.63 on average (69 % alone): the turns of one conversation, each prompt (median)
94 % the one before it. Here a conversation has a geometric number of turns with that mean;
its first prompt's length is drawn from the published first turns' (mean 10,765 tokens); each
later prompt is the one before, that turn's answer and a new message (drawn from what the
published turns added beyond the previous prompt and answer: median 24 tokens, 90th percentile
4,279), so the turn before is a prefix of it. The first ``SYSTEM_TOKENS`` of every prompt are
shared by all. Prompts stop at the published maximum, 126,195 tokens.

Hash ids are per ``--block-size`` tokens (64: what ``pdserve simulate`` and ``plan`` use by
default; give them the same ``--block-size``). Conversations start as a Poisson process at the
published rate over its mean turns; a conversation's next turn follows an exponential think
time (``THINK_S`` mean: the published trace does not say). Replay rescales the timestamps to
the rate asked for (``--request-rate``), think times with them. The final JSON line gives the
generated means and the share of prompt tokens an infinite prefix cache would serve (37 % on
the published trace at its 512-token blocks).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# (quantile, tokens) of the Mooncake FAST'25 conversation trace (see the module docstring):
# a conversation's first prompt, what each later prompt adds beyond the previous prompt and its
# answer (at least 1), and an answer
FIRST_PROMPT_QUANTILES: tuple[tuple[float, int], ...] = (
    (0.0, 891), (0.1, 905), (0.2, 1092), (0.3, 1757), (0.4, 3914), (0.5, 5264), (0.6, 7417),
    (0.7, 10768), (0.8, 15871), (0.9, 25561), (0.95, 38464), (0.99, 89867), (1.0, 126195),
)  # fmt: skip
MESSAGE_QUANTILES: tuple[tuple[float, int], ...] = (
    (0.0, 1), (0.1, 1), (0.2, 4), (0.3, 9), (0.4, 14), (0.5, 24), (0.6, 52), (0.7, 213),
    (0.8, 1009), (0.9, 4279), (0.95, 7058), (0.99, 16705), (1.0, 91467),
)  # fmt: skip
OUTPUT_QUANTILES: tuple[tuple[float, int], ...] = (
    (0.0, 1), (0.01, 3), (0.05, 10), (0.1, 24), (0.2, 100), (0.3, 213), (0.4, 291), (0.5, 350),
    (0.6, 399), (0.7, 447), (0.8, 504), (0.9, 597), (0.95, 698), (0.98, 891), (0.99, 1120),
    (0.995, 1570), (1.0, 2000),
)  # fmt: skip
MAX_PROMPT = 126195  # the longest published prompt
MEAN_TURNS = 1.63  # rows per run of a shared second block in the published trace
SYSTEM_TOKENS = 512  # the block every published row starts with
RATE = 12031 / 3600  # the published trace's requests per second
THINK_S = 60.0  # mean time from one turn to the next (not published; rescaled on replay)


@dataclass(frozen=True)
class Row:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "timestamp": self.timestamp_ms,
                "input_length": self.input_length,
                "output_length": self.output_length,
                "hash_ids": list(self.hash_ids),
            }
        )


def draw(quantiles: Sequence[tuple[float, int]], rng: random.Random) -> int:
    """A length from the quantile table: inverse CDF, log-linear between the points."""
    u = rng.random()
    ps = [p for p, _ in quantiles]
    i = max(1, min(len(ps) - 1, bisect.bisect_right(ps, u)))
    (p0, x0), (p1, x1) = quantiles[i - 1], quantiles[i]
    f = (u - p0) / (p1 - p0) if p1 > p0 else 0.0
    return max(1, round(math.exp(math.log(x0) + f * (math.log(x1) - math.log(x0)))))


def conversation(rng: random.Random) -> list[tuple[int, int]]:
    """One conversation's turns: (prompt tokens, answer tokens), each prompt extending the one
    before by that turn's answer and a new message."""
    turns = 1
    while rng.random() > 1 / MEAN_TURNS:
        turns += 1
    prompt = max(SYSTEM_TOKENS + 1, draw(FIRST_PROMPT_QUANTILES, rng))
    out = []
    for _ in range(turns):
        answer = draw(OUTPUT_QUANTILES, rng)
        out.append((prompt, answer))
        prompt += answer + draw(MESSAGE_QUANTILES, rng)
        if prompt > MAX_PROMPT:
            break
    return out


def generate(rows: int, seed: int = 0, block_size: int = 64) -> list[Row]:
    """The first ``rows`` requests, by arrival, of conversations as described above."""
    if rows < 0 or block_size < 1:
        raise ValueError("rows must be >= 0 and block_size >= 1")
    rng = random.Random(seed)
    system = math.ceil(SYSTEM_TOKENS / block_size)  # hash ids 0..system-1: in every prompt
    next_id = system
    out: list[tuple[float, int, Row]] = []
    t = 0.0
    # Conversations start until the next would start after the ``rows``-th earliest arrival
    # so far: every row of it, and of those after it, would come later.
    while len(out) < rows or t <= sorted(r[0] for r in out)[rows - 1]:
        t += rng.expovariate(RATE / MEAN_TURNS)
        turns = conversation(rng)
        blocks = math.ceil(turns[-1][0] / block_size)
        stream = [*range(system), *range(next_id, next_id + blocks - system)]
        next_id += blocks - system
        at = t
        for prompt, answer in turns:
            row = Row(round(at * 1000), prompt, answer, tuple(stream[: math.ceil(prompt / block_size)]))
            out.append((at, len(out), row))
            at += rng.expovariate(1 / THINK_S)
    out.sort(key=lambda r: (r[0], r[1]))
    return [r for _, _, r in out[:rows]]


def cached_fraction(rows: Sequence[Row], block_size: int) -> float:
    """Prompt tokens an infinite prefix cache serves (whole blocks any earlier row had)."""
    seen: set[int] = set()
    hit = total = 0
    for r in rows:
        n = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            n += 1
        seen.update(r.hash_ids)
        hit += min(n * block_size, r.input_length)
        total += r.input_length
    return hit / total if total else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the JSONL trace to write")
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=64, help="tokens per hash id (as plan's --block-size)")
    args = ap.parse_args()
    rows = generate(args.rows, args.seed, args.block_size)
    args.out.write_text("".join(r.to_json() + "\n" for r in rows))
    n = max(1, len(rows))
    print(
        json.dumps(
            {
                "out": str(args.out),
                "rows": len(rows),
                "seed": args.seed,
                "block_size": args.block_size,
                "mean_input": sum(r.input_length for r in rows) / n,
                "mean_output": sum(r.output_length for r in rows) / n,
                "cached_fraction": cached_fraction(rows, args.block_size),
                "span_s": rows[-1].timestamp_ms / 1000 if rows else 0.0,
            },
            sort_keys=True,
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
