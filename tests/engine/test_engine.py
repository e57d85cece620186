"""The colocated engine on the embedded tiny model: errors, preemption, aborts, stop strings, seeds."""

from __future__ import annotations

import pytest

from pdserve.decode_worker.engine import DecodeEngine
from pdserve.decode_worker.offline import OfflineDriver
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.request import FinishReason
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from pdserve.worker.messages import WorkerRole

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def engine(num_blocks: int = 256, **sched: int) -> OfflineDriver:
    return OfflineDriver(
        EngineConfig(
            model="tiny",
            device="cpu",
            cache=CacheConfig(block_size=16, num_blocks=num_blocks),
            scheduler=SchedulerConfig(**{"max_num_batched_tokens": 256, **sched}),
        )
    )


@pytest.fixture(scope="module")
def eng() -> OfflineDriver:
    return engine()


PROMPTS = [f"request number {i}: " + "lorem ipsum " * (i * 2) for i in range(8)]


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ("x" * 3000, SamplingParams(max_tokens=1), "prompt"),  # longer than the context (2048)
        ("hi", SamplingParams(max_tokens=0), "max_tokens"),
        ("hi", SamplingParams(max_tokens=3000), "max_tokens"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(top_p=1.01), "top_p"),
        ([5, 999_999], SamplingParams(), "prompt"),
        ([-1], SamplingParams(), "prompt"),
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
    ],
)
def test_bad_input_is_rejected_and_engine_keeps_serving(
    eng: OfflineDriver, prompt: str | list[int], params: SamplingParams, field: str
) -> None:
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("bad", prompt, params)
    assert e.value.field == field
    assert not eng.has_unfinished
    out = eng.generate(["still serving"], GREEDY)[0]
    assert len(out.token_ids) == 24
    eng.check_integrity()


def test_duplicate_request_id_is_rejected(eng: OfflineDriver) -> None:
    eng.add_request("dup", "a", GREEDY)
    with pytest.raises(InvalidRequestError):
        eng.add_request("dup", "b", GREEDY)
    assert eng.abort("dup")
    eng.check_integrity()


def test_preemption_under_a_tiny_pool_gives_the_same_tokens() -> None:
    reference = engine().generate(PROMPTS, GREEDY)
    small = engine(num_blocks=16, max_num_batched_tokens=64)  # 256 tokens for 8 requests of 43-211
    got = small.generate(PROMPTS, GREEDY)
    assert small.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in reference]
    assert [o.text for o in got] == [o.text for o in reference]
    small.check_integrity()
    assert small.kv.stats().used == 0


def test_abort_mid_flight_frees_blocks(eng: OfflineDriver) -> None:
    eng.add_request("a", PROMPTS[3], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    eng.add_request("b", PROMPTS[5], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.kv.stats().used > 0
    assert eng.abort("a")
    assert not eng.abort("a")
    while eng.has_unfinished:
        eng.step()
    eng.check_integrity()
    assert eng.kv.stats().used == 0


def test_stop_string_and_stop_token(eng: OfflineDriver) -> None:
    base = eng.generate([PROMPTS[1]], GREEDY)[0]
    assert base.text
    stop = base.text[5:8]
    first = base.text.index(stop)
    out = eng.generate(
        [PROMPTS[1]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(stop,))
    )[0]
    assert out.text == base.text[:first]
    assert out.finish_reason is FinishReason.STOP_STRING and out.stop_reason == stop
    tok = base.token_ids[3]
    out = eng.generate(
        [PROMPTS[1]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=(tok,))
    )[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(tok) + 1]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == tok
    eng.check_integrity()


def test_seeded_sampling_is_independent_of_batch(eng: OfflineDriver) -> None:
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    alone = eng.generate([PROMPTS[2]], p)[0].token_ids
    noisy = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    mixed = eng.generate([PROMPTS[0], PROMPTS[2], PROMPTS[4]], [noisy, p, noisy])[1].token_ids
    assert alone == mixed


def test_streaming_text_deltas_concatenate_to_final_text(eng: OfflineDriver) -> None:
    eng.add_request("s", "stream me", SamplingParams(max_tokens=30, temperature=0.7, seed=1, ignore_eos=True))
    deltas, final = [], None
    while eng.has_unfinished:
        for out in eng.step():
            deltas.append(out.new_text)
            final = out
    assert final is not None and final.finished
    assert "".join(deltas) == final.text
    assert final.usage.prompt_tokens == len(final.prompt_token_ids) and final.usage.completion_tokens == 30


def test_prefix_cache_hit_is_reported_in_usage(eng: OfflineDriver) -> None:
    prompt = "shared system prompt " * 10
    eng.generate([prompt + "A"], GREEDY)
    out = eng.generate([prompt + "B"], GREEDY)[0]
    assert out.usage.cached_tokens >= 16 * ((len(prompt) - 1) // 16) - 16


def test_logprobs_are_returned_per_token(eng: OfflineDriver) -> None:
    out = eng.generate(["x"], SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok and lp.top[0][0] == tok and len(lp.top) == 3


def test_the_driver_runs_the_one_colocated_engine(eng: OfflineDriver) -> None:
    """``generate`` steps the decode engine in its colocated role, the engine ``--colocated``
    serves with: a stop string ends the request on it, and it ends idle."""
    assert type(eng.engine) is DecodeEngine and eng.engine.role is WorkerRole.COLOCATED
    base = eng.generate([PROMPTS[2]], GREEDY)[0]
    assert base.text
    stop = base.text[4:7]
    eng.add_request(
        "stop", PROMPTS[2], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(stop,))
    )
    assert eng.engine.held("stop") is not None
    outs = []
    while eng.has_unfinished:
        outs += eng.step()
    assert outs[-1].finish_reason is FinishReason.STOP_STRING and len(outs[-1].token_ids) < 24
    assert eng.engine.held("stop") is None and eng.engine.idle
    eng.check_integrity()
