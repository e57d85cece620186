"""The ``paged`` backend's step structure, checked without a GPU.

* its Triton kernels, interpreted, give Hugging Face's greedy tokens through the whole engine;
* the decode graph region runs on the ``meta`` device (nothing in it reads device data on the
  host), within an op budget per layer and with one host→device copy per step;
* two decode steps in one bucket run the same ops on the same shapes and the same buffers;
* ``torch.compile(fullgraph=True)`` traces the forward without a graph break.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pdserve.decode_worker.offline import OfflineDriver
from pdserve.model_runtime.backend import Backend
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.engine.model_runner import GraphSettings, ModelRunner
from pdserve.model_runtime.engine.step_inputs import pack_step, unpack
from pdserve.model_runtime.kv_cache.tensors import kv_cache_shape, new_kv_cache
from pdserve.model_runtime.model.loader import load_model
from pdserve.model_runtime.presets import resolve_model
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import PENDING_TOKEN, ScheduledChunk, SchedulerConfig
from tests.engine.hf_models import hf_greedy, make_hf_model

BLOCK = 16
# What one decoder layer of the paged backend may dispatch: 8 fused or linear ops and the views
# between them (15 in all today; the torch backend dispatches 68 for the same layer).
OPS_PER_LAYER = 15


class OpTrace(TorchDispatchMode):
    """Every aten/custom op dispatched, with its tensor arguments' devices, shapes and storages."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[Any, ...]]] = []
        self.host_to_device = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.ops.append((str(func), tuple((t.device.type, tuple(t.shape), _address(t)) for t in tensors)))
        if (
            func is torch.ops.aten.copy_.default
            and args[1].device.type == "cpu"
            and args[0].device.type != "cpu"
        ):
            self.host_to_device += 1
        return func(*args, **(kwargs or {}))


def _address(t: torch.Tensor) -> int:
    try:
        return int(t.data_ptr())
    except RuntimeError:  # oneDNN's packed weights have no plain storage
        return -1


@contextmanager
def traced() -> Iterator[OpTrace]:
    with OpTrace() as trace:
        yield trace


def _decode_chunks(lens: list[int], first_block: int = 1) -> list[ScheduledChunk]:
    chunks, block = [], first_block
    for i, n in enumerate(lens):
        used = -(-n // BLOCK)
        table = tuple(range(block, block + used))
        block += used
        chunks.append(ScheduledChunk(f"r{i}", (5,), n - 1, table, sample=True))
    return chunks


def _runner(device: str, max_rows: int = 8, max_len: int = 256) -> ModelRunner:
    checkpoint = resolve_model("tiny")
    config = checkpoint.model_config()
    model = load_model(checkpoint, config, torch.device(device), torch.float32, max_len, Backend.PAGED)
    cache = new_kv_cache(kv_cache_shape(config, 64, BLOCK), torch.float32, device)
    return ModelRunner(
        config, model, 64, BLOCK, kv_cache=cache, graphs=GraphSettings(max_rows, max_len, False)
    )


def test_decode_graph_region_runs_on_meta_within_the_op_budget() -> None:
    runner = _runner("meta")
    graphs = runner.graphs
    assert graphs is not None and runner.kv_cache.is_meta
    layers = runner.config.num_layers
    with traced() as trace:
        logits, ids = graphs.run(_decode_chunks([17, 40, 3]))
    assert logits.is_meta and logits.shape == (3, runner.config.vocab_size)
    assert ids == ["r0", "r1", "r2"]
    assert trace.host_to_device == 1
    names = [name for name, _ in trace.ops]
    assert "aten._local_scalar_dense.default" not in names  # no .item() / .tolist() of device data
    device_ops = [op for op in trace.ops if any(dev == "meta" for dev, _, _ in op[1])]
    assert len(device_ops) <= OPS_PER_LAYER * layers + 6, names
    for name in ("pdserve.paged_decode", "pdserve.rope_write_kv", "pdserve.add_rms_norm", "pdserve.silu_mul"):
        assert sum(n.startswith(name) for n in names) >= layers, name


def test_two_decode_steps_in_one_bucket_keep_shapes_and_buffers() -> None:
    runner = _runner("cpu")
    graphs = runner.graphs
    assert graphs is not None

    buffer, cache = graphs.stager.device_buffer, runner.kv_cache
    persistent = [
        (buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes),
        (cache.data_ptr(), cache.data_ptr() + cache.untyped_storage().nbytes()),
    ]

    def trace_of(lens: list[int]) -> list[tuple[str, tuple[Any, ...]]]:
        """The step's ops with each argument's shape, and its address where that is inside the
        step-input buffer or the KV cache (what a captured graph bakes in); intermediates are
        eager allocations here and a graph's private pool on a GPU."""
        with traced() as trace:
            graphs.run(_decode_chunks(lens))
        out = []
        for name, args in trace.ops:
            if name.startswith("pdserve.") or name.startswith("aten.embedding"):
                out.append(
                    (
                        name,
                        tuple(
                            (shape, addr if any(a <= addr < b for a, b in persistent) else None)
                            for _, shape, addr in args
                        ),
                    )
                )
        return out

    first = trace_of([17, 40, 3])  # 3 rows: bucket 4
    second = trace_of([90, 2, 33, 5])  # 4 rows, other lengths and blocks: bucket 4
    assert first == second
    assert sum(addr is not None for _, args in first for _, addr in args) > 4 * runner.config.num_layers
    third = trace_of([17, 40])  # bucket 2: its own (smaller) layout
    assert third != first


def test_padding_rows_write_no_kv() -> None:
    runner = _runner("cpu")
    graphs = runner.graphs
    assert graphs is not None
    runner.kv_cache.fill_(3.0)
    chunks = _decode_chunks([17, 40, 3])
    graphs.run(chunks)  # bucket 4: one padding row
    written = {(b, (c.start_pos) % BLOCK) for c in chunks for b in [c.block_table[c.start_pos // BLOCK]]}
    for block in range(64):
        for offset in range(BLOCK):
            changed = not bool((runner.kv_cache[:, block, :, offset] == 3.0).all())
            assert changed == ((block, offset) in written), (block, offset)


def test_forward_compiles_without_graph_breaks() -> None:
    runner = _runner("cpu")
    chunks = [
        *_decode_chunks([17, 40]),
        ScheduledChunk("p", tuple(range(3, 23)), 0, (10, 11), sample=True),
        ScheduledChunk("q", tuple(range(3, 8)), 32, (12, 13, 14), sample=True),
    ]
    packed = pack_step(chunks, BLOCK)
    buffer = torch.tensor(packed.values, dtype=torch.int32)
    inp = unpack(buffer, packed.layout, packed.prefill_max_q, 0, sample_all=False)
    model = runner.model

    def forward(ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return model.forward(ids, pos, inp.meta, runner.kv_cache, rows)

    assert inp.sample_rows is not None
    eager = forward(inp.input_ids, inp.positions, inp.sample_rows)
    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(inp.input_ids, inp.positions, inp.sample_rows), eager)


def test_triton_kernels_interpreted_give_hf_tokens(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from pdserve.model_runtime.kernels.ops import kernels_on_cpu

    # Four tokens: every step runs interpreted, and the decode steps after the third add no
    # case (the 70-token prompt's decode is past the window from its first token).
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for kind in ("llama", "qwen2", "mistral"):
        path = tmp_path / kind
        model = make_hf_model(kind, path, seed=3)
        # 70 tokens under a 40-token budget: a chunk that continues a cached prefix, and past
        # the Mistral model's 64-token window.
        prompts = [list(range(3, 3 + n)) for n in (1, 17, 70)]
        expected = [hf_greedy(model, p, 4)[0] for p in prompts]
        engine = OfflineDriver(
            EngineConfig(
                model=str(path),
                device="cpu",
                backend="paged",
                cache=CacheConfig(num_blocks=64),
                scheduler=SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=4),
            )
        )
        assert engine.runner.graphs is not None
        with kernels_on_cpu():
            got = [o.token_ids for o in engine.generate(prompts, greedy)]
        assert got == expected, kind


def test_a_step_ahead_takes_its_inputs_on_the_device_with_one_upload() -> None:
    """An overlapped decode step's rows read the previous step's sampled tokens where they lie:
    no host read of device data, still one host→device copy."""
    runner = _runner("meta")
    graphs = runner.graphs
    assert graphs is not None
    chunks = [
        dataclasses.replace(c, token_ids=(PENDING_TOKEN,), pending=True) if i != 1 else c
        for i, c in enumerate(_decode_chunks([17, 40, 3]))
    ]
    previous = ({"r0": 1, "r2": 0}, torch.empty(2, dtype=torch.long, device="meta"))
    with traced() as trace:
        logits, ids = graphs.run(chunks, previous)
    assert logits.is_meta and ids == ["r0", "r1", "r2"]
    assert trace.host_to_device == 1
    assert "aten._local_scalar_dense.default" not in [name for name, _ in trace.ops]
    with pytest.raises(RuntimeError, match="pending"):
        graphs.run(chunks, ({"r0": 1}, previous[1]))  # r2's token is not among them


def test_pending_inputs_are_filled_in_from_the_previous_step() -> None:
    """Through the eager packed path and the graph layout alike, a pending row computes exactly
    what the same row with the token written in does."""
    for via_graph in (False, True):
        runner = _runner("cpu")
        known = _decode_chunks([17, 40, 3])
        pending = [dataclasses.replace(c, token_ids=(PENDING_TOKEN,), pending=True) for c in known]
        previous = ({"r0": 2, "r1": 0, "r2": 3}, torch.tensor([5, 9, 5, 5]))
        if via_graph:
            assert runner.graphs is not None
            expect = runner.graphs.run(known)[0].clone()
            runner.kv_cache.zero_()
            got = runner.graphs.run(pending, previous)[0]
        else:
            prefill = ScheduledChunk("p", tuple(range(3, 23)), 0, (30, 31), sample=True)
            expect = runner._forward([*known, prefill], None, None)[0].clone()
            runner.kv_cache.zero_()
            got = runner._forward([*pending, prefill], None, previous)[0]
        torch.testing.assert_close(got, expect)
