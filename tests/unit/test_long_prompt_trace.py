"""The long-prompt multi-turn trace (``benchmarks/long_prompt_trace.py``): deterministic, the
published means, and a conversation's turns sharing its prefix."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from benchmarks.long_prompt_trace import SYSTEM_TOKENS, Row, cached_fraction, generate
from pdserve.bench.workload import read_trace


def test_the_trace_is_deterministic_by_seed_and_has_the_published_shape() -> None:
    rows = generate(3000, seed=5)
    assert rows == generate(3000, seed=5) and rows != generate(3000, seed=6)
    assert [r.timestamp_ms for r in rows] == sorted(r.timestamp_ms for r in rows)
    mean_in = sum(r.input_length for r in rows) / len(rows)
    mean_out = sum(r.output_length for r in rows) / len(rows)
    # the Mooncake conversation trace: 12,035 and 343 tokens; 37 % served by a prefix cache
    assert 10_000 < mean_in < 14_000 and 300 < mean_out < 390
    assert 0.3 < cached_fraction(rows, 64) < 0.45
    system = SYSTEM_TOKENS // 64
    assert all(r.hash_ids[:system] == tuple(range(system)) for r in rows)
    assert all(len(r.hash_ids) == -(-r.input_length // 64) for r in rows)


def test_a_later_turn_extends_an_earlier_prompt_of_its_conversation() -> None:
    rows = generate(2000, seed=1)
    by_block: dict[int, list[Row]] = {}
    for r in rows:  # a conversation's own blocks start right after the shared system prompt
        by_block.setdefault(r.hash_ids[SYSTEM_TOKENS // 64], []).append(r)
    turns = [c for c in by_block.values() if len(c) > 1]
    assert len(turns) > 200
    for conv in turns:
        for a, b in itertools.pairwise(conv):
            assert b.input_length > a.input_length + a.output_length
            assert b.hash_ids[: len(a.hash_ids)] == a.hash_ids


def test_the_trace_file_replays_as_a_jsonl_trace(tmp_path: Path) -> None:
    rows = generate(50, seed=2, block_size=16)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in rows))
    replay = read_trace(path)
    assert [(t.input_len, t.output_len, t.hash_ids) for t in replay] == [
        (r.input_length, r.output_length, r.hash_ids) for r in rows
    ]
    assert json.loads(path.read_text().splitlines()[0])["timestamp"] == rows[0].timestamp_ms
