"""How close the engine runs to this machine's limits, and how it compares with HF transformers.

On the ``bench`` preset (about 100M parameters, float32), or any ``--model`` (``smollm2-135m``:
the real SmolLM2-135M-Instruct from its GGUF):

* decode tokens/s at batch 1, 8, 32 and MBU = bytes a decode step must read (weights + KV) /
  step time / memory read bandwidth measured in this run;
* prefill tokens/s at 512 and 2,048 tokens and MFU = prefill FLOP/s / the best large matmul
  FLOP/s measured in this run (FLOPs count only what a causal prefill needs: the masked half of
  attention is not counted; ``prefill_mfu_2048_full_attn`` counts it, as PaLM-style MFU does);
* the same 32 requests (prompts 16-512, outputs 16-256 tokens) through our engine (all at once,
  continuous batching) and through HF ``generate`` one at a time and in static padded batches
  of 8;
* transformers' own decode step at batch 1 and 8 and its 512-token prefill on the same model
  (``hf_decode_tok_s_b*``, ``hf_prefill_tok_s_512``), next to ours.

Run: ``.venv/bin/python -m benchmarks.engine_roofline`` (about 5 minutes; ``--skip-hf`` for
the first two parts only). The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

import torch

from benchmarks.common import emit, matmul_flops, median_time, memory_copy_bandwidth, memory_read_bandwidth
from pdserve.decode_worker.offline import OfflineDriver
from pdserve.model_runtime.checkpoint import Format
from pdserve.model_runtime.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.model_runtime.engine.model_runner import ModelRunner
from pdserve.model_runtime.presets import resolve_model
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import SchedulerConfig


def weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Bytes a decode step reads from weights: every matrix once (the embedding only one row)."""
    h = cfg.hidden_size
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size + 2 * h
    return (cfg.num_layers * per_layer + cfg.vocab_size * h + h) * dtype_bytes


def prefill_flops(cfg: ModelConfig, n: int, causal: bool = True) -> float:
    h = cfg.hidden_size
    matmul_params = cfg.num_layers * (
        h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size
    )
    linear = 2 * n * matmul_params + 2 * h * cfg.vocab_size  # logits for the last position only
    pairs = n * (n + 1) / 2 if causal else n * n  # (query, key) pairs attended
    attention = cfg.num_layers * 2 * 2 * pairs * cfg.q_size  # QK^T and PV
    return linear + attention


def make_engine(model: str, device: str, dtype: str | None) -> OfflineDriver:
    return OfflineDriver(
        EngineConfig(
            model=model,
            device=device,
            dtype=dtype,
            cache=CacheConfig(block_size=16, num_blocks=6144),
            scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64),
        )
    )


def measure_decode(engine: OfflineDriver, batch: int, prompt_len: int, steps: int) -> float:
    """Median time of a decode-only step with ``batch`` running requests."""
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(
            f"d{batch}-{i}", prompt, SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
        )
    while engine.scheduler.num_waiting or engine.scheduler.prefill.num_running:
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished:
        engine.step()
    engine.check_integrity()
    return statistics.median(times)


def measure_prefill(engine: OfflineDriver, n: int) -> float:
    vocab = engine.model_config.vocab_size
    rng = random.Random(n)

    def once() -> None:
        engine.kv.pool.reset_prefix_cache()  # every repetition computes the whole prompt
        engine.add_request(
            "p", [rng.randrange(3, vocab) for _ in range(n)], SamplingParams(max_tokens=1, temperature=0)
        )
        while engine.has_unfinished:
            engine.step()

    return median_time(once, repeat=1, warmup=1, device=engine.device)


def workload(n: int = 32, seed: int = 0, vocab: int = 32000) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(16, 512))], rng.randint(16, 256))
        for _ in range(n)
    ]


def run_ours(engine: OfflineDriver, reqs: list[tuple[list[int], int]]) -> float:
    t0 = time.perf_counter()
    outs = engine.generate(
        [p for p, _ in reqs], [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in reqs]
    )
    dt = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == [o for _, o in reqs]
    engine.check_integrity()
    return dt


def load_hf(model: str) -> Any:
    """The same checkpoint in transformers, float32 (a GGUF dequantized by its own loader)."""
    import transformers

    transformers.logging.set_verbosity_error()
    checkpoint = resolve_model(model)
    if checkpoint.format is Format.GGUF:
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(checkpoint.directory), gguf_file=checkpoint.path.name, dtype=torch.float32
        ).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint.path), dtype=torch.float32).eval()


def hf_steps(model: Any, vocab: int, prompt_len: int, steps: int) -> dict[str, float]:
    """transformers' decode step (batch 1 and 8: ``generate`` of ``steps`` tokens less a
    1-token ``generate``, per step) and its 512-token prefill (one forward), medians of 3."""
    rng = random.Random(7)
    out: dict[str, float] = {}
    with torch.inference_mode():
        for b in (1, 8):
            ids = torch.tensor([[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(b)])

            def gen(n: int, ids: torch.Tensor = ids) -> float:
                t0 = time.perf_counter()
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
                return time.perf_counter() - t0

            gen(2)  # warm-up
            per_step = statistics.median((gen(steps) - gen(1)) / (steps - 1) for _ in range(3))
            out[f"hf_decode_step_ms_b{b}"] = per_step * 1e3
            out[f"hf_decode_tok_s_b{b}"] = b / per_step
        ids = torch.tensor([[rng.randrange(3, vocab) for _ in range(512)]])
        model(input_ids=ids)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            model(input_ids=ids)
            times.append(time.perf_counter() - t0)
        out["hf_prefill_tok_s_512"] = 512 / statistics.median(times)
    return out


def run_hf(model: Any, reqs: list[tuple[list[int], int]], batch: int) -> float:
    pad = 258
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(reqs), batch):
            group = reqs[i : i + batch]
            width = max(len(p) for p, _ in group)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
            new = max(o for _, o in group)  # a static batch runs until its longest request ends
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
            assert out.shape[1] == width + new
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--skip-hf", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--decode-prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--decode-rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (GPU runs: --skip-hf)")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    engine = make_engine(args.model, args.device, args.dtype)  # applies the engine's process settings
    runner = engine.runner
    assert isinstance(runner, ModelRunner), "a real model's runner: its dtype and linear backend"
    device = engine.device
    cfg = engine.model_config
    dtype_bytes = runner.kv_cache.element_size()
    res: dict[str, Any] = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "dtype": str(runner.dtype),
    }
    print(
        f"model {args.model} on {device}: {cfg.num_parameters() / 1e6:.1f}M parameters, "
        f"linear backend {runner.model.lm_head.backend}",
        flush=True,
    )

    read_bw = memory_read_bandwidth(device, 512 if device.type == "cpu" else 4096)
    copy_bw = memory_copy_bandwidth(device, 512 if device.type == "cpu" else 4096)
    mm = matmul_flops(device, runner.dtype, 2048 if device.type == "cpu" else 8192)
    best_mm = max(mm.values())
    res.update(
        read_bw_gbs=read_bw / 1e9,
        copy_bw_gbs=copy_bw / 1e9,
        **{f"matmul_{k}_gflops": v / 1e9 for k, v in mm.items()},
        matmul_best_gflops=best_mm / 1e9,
    )
    print(
        f"ceilings: read {read_bw / 1e9:.1f} GB/s, copy {copy_bw / 1e9:.1f} GB/s, "
        + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in mm.items()),
        flush=True,
    )

    kv_token = cfg.kv_bytes_per_token(dtype_bytes)
    wbytes = weight_bytes(cfg, dtype_bytes)
    # This VM's memory and compute speed drift by tens of percent within minutes, so every
    # measurement is paired with a ceiling taken right before it, rounds alternate the batch
    # sizes, and each figure is the median over rounds of its per-round ratio.
    ctx = args.decode_prompt_len + args.decode_steps // 2  # the median step's context
    per_round: dict[str, list[float]] = {}
    for _ in range(args.decode_rounds):
        bw = memory_read_bandwidth(device, 512 if device.type == "cpu" else 4096)
        per_round.setdefault("read_bw_gbs", []).append(bw / 1e9)
        tok_s = {}
        for b in (1, 8, 32):
            dt = measure_decode(engine, b, args.decode_prompt_len, args.decode_steps)
            tok_s[b] = b / dt
            per_round.setdefault(f"decode_step_ms_b{b}", []).append(dt * 1e3)
            per_round.setdefault(f"decode_tok_s_b{b}", []).append(b / dt)
            per_round.setdefault(f"decode_mbu_b{b}", []).append((wbytes + b * ctx * kv_token) / dt / bw)
        per_round.setdefault("decode_speedup_b32_vs_b1", []).append(tok_s[32] / tok_s[1])
    for n in (512, 2048):
        for _ in range(3):
            mm_now = max(matmul_flops(device, runner.dtype, 2048 if device.type == "cpu" else 8192).values())
            dt = measure_prefill(engine, n)
            per_round.setdefault(f"prefill_tok_s_{n}", []).append(n / dt)
            per_round.setdefault(f"prefill_mfu_{n}", []).append(prefill_flops(cfg, n) / dt / mm_now)
            per_round.setdefault(f"prefill_mfu_{n}_full_attn", []).append(
                prefill_flops(cfg, n, causal=False) / dt / mm_now
            )
    for key, values in per_round.items():
        res[key] = statistics.median(values)
        res[key + "_rounds"] = [round(v, 3) for v in values]
    for b in (1, 8, 32):
        print(
            f"decode b={b}: {res[f'decode_step_ms_b{b}']:.2f} ms/step, "
            f"{res[f'decode_tok_s_b{b}']:.0f} tok/s, MBU {res[f'decode_mbu_b{b}']:.2f}",
            flush=True,
        )
    print(f"decode b32/b1: {res['decode_speedup_b32_vs_b1']:.1f}x", flush=True)
    for n in (512, 2048):
        print(
            f"prefill {n}: {n / res[f'prefill_tok_s_{n}'] * 1e3:.0f} ms, "
            f"{res[f'prefill_tok_s_{n}']:.0f} tok/s, MFU {res[f'prefill_mfu_{n}']:.2f}",
            flush=True,
        )

    reqs = workload(vocab=cfg.vocab_size)
    res["workload_output_tokens"] = sum(o for _, o in reqs)
    res["ours_32req_s"] = run_ours(engine, reqs)
    print(f"32 requests: ours {res['ours_32req_s']:.1f} s", flush=True)
    if not args.skip_hf:
        hf = load_hf(args.model)
        res.update(hf_steps(hf, cfg.vocab_size, args.decode_prompt_len, args.decode_steps))
        for b in (1, 8):
            print(
                f"transformers decode b={b}: {res[f'hf_decode_step_ms_b{b}']:.2f} ms/step, "
                f"{res[f'hf_decode_tok_s_b{b}']:.0f} tok/s (ours {res[f'decode_tok_s_b{b}']:.0f})",
                flush=True,
            )
        print(f"transformers prefill 512: {res['hf_prefill_tok_s_512']:.0f} tok/s", flush=True)
        res["hf_batch8_32req_s"] = run_hf(hf, reqs, 8)
        print(f"32 requests: HF static batches of 8 {res['hf_batch8_32req_s']:.1f} s", flush=True)
        res["hf_single_32req_s"] = run_hf(hf, reqs, 1)
        print(f"32 requests: HF one at a time {res['hf_single_32req_s']:.1f} s", flush=True)
        res["vs_hf_speedup"] = min(res["hf_batch8_32req_s"], res["hf_single_32req_s"]) / res["ours_32req_s"]
    emit(res)


if __name__ == "__main__":
    main()
