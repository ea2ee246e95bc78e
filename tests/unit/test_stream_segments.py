"""StreamEngine's provenance rules without an engine: vLLM's weight-version spans -> segments, refit checks.

    python -m pytest tests/unit/test_stream_segments.py -q

The engine-side behaviour these rules stand on is proven in tests/e2e/test_stream_refit.py.
"""

import asyncio
from types import SimpleNamespace

import pytest

from megatron_rl.rollout.stream_engine import Segment, StreamEngine, _segments

pytestmark = pytest.mark.unit


def span(version, start, end):
    return SimpleNamespace(version=version, start=start, end=end)  # vllm.outputs.WeightVersionSpan's fields


def test_segments_carry_each_versions_kv_epoch():
    # admitted at 3; a keep_kv refit to 4 (KV still from 3), then a recompute refit to 5.
    got = _segments([span("3", 0, 5), span("4", 5, 9), span("5", 9, 12)], 12, {3: 3, 4: 3, 5: 5})
    assert got == [Segment(0, 5, 3, 3), Segment(5, 9, 4, 3), Segment(9, 12, 5, 5)]
    assert _segments(None, 0, {0: 0}) == []


@pytest.mark.parametrize("spans, n, why", [
    (None, 4, "no weight-version spans"),
    ([span("0", 0, 3)], 4, "do not tile"),
    ([span("0", 0, 2), span("1", 3, 4)], 4, "do not tile"),
    ([span("0", 1, 4)], 4, "do not tile"),
])
def test_spans_that_do_not_account_for_every_token_are_refused(spans, n, why):
    with pytest.raises(RuntimeError, match=why):
        _segments(spans, n, {0: 0, 1: 1})


def test_a_label_from_outside_this_engine_is_refused():
    # vLLM's own default label ("default") or another writer's: provenance unknown, not guessed.
    with pytest.raises(RuntimeError, match="weight version 'default'"):
        _segments([span("default", 0, 4)], 4, {0: 0})
    with pytest.raises(RuntimeError, match="weight version '7'"):
        _segments([span("7", 0, 4)], 4, {0: 0})


@pytest.mark.parametrize("mode, version, why", [("keep", 1, "inflight_refit 'keep'"), ("recompute", 0, "already serves")])
def test_refit_arguments_are_checked_before_the_engine_is_touched(mode, version, why):
    async def load():
        raise AssertionError("load ran")

    with pytest.raises(ValueError, match=why):
        asyncio.run(StreamEngine(engine=None).refit(load, version, mode))


def test_an_engine_that_kept_stale_kv_serves_nothing_more():
    from megatron_rl.rollout.stream_engine import StaleCacheError

    stream = StreamEngine(engine=None)
    stream._labelled, stream._broken = True, StaleCacheError("reset refused")
    with pytest.raises(RuntimeError, match="stopped serving: reset refused"):
        asyncio.run(stream.generate("r", [1, 2], {"max_tokens": 2}))
    with pytest.raises(RuntimeError, match="refused: reset refused"):
        asyncio.run(stream.refit(None, 1, "recompute"))


def test_the_worker_extension_vllm_is_told_to_load_exists():
    import importlib

    from megatron_rl.publish.vllm_engine import PublicationWorkerExtension
    from megatron_rl.rollout.stream_engine import WORKER_EXTENSION

    module, _, name = WORKER_EXTENSION.rpartition(".")
    ext = getattr(importlib.import_module(module), name)
    assert issubclass(ext, PublicationWorkerExtension) and callable(ext.megatron_rl_load_checkpoint)


def test_a_load_that_cannot_roll_back_aborts_the_requests_in_flight_until_whole_weights_load():
    from megatron_rl.rollout.stream_engine import BrokenWeights, _Flight, StreamResult

    calls = []

    class Engine:  # test double of AsyncLLM: records what the refit asks of it
        errored = False

        async def pause_generation(self, **kw):
            calls.append(("pause", kw["mode"]))

        async def resume_generation(self):
            calls.append(("resume",))

        async def abort(self, ids):
            calls.append(("abort", sorted(ids)))

        async def update_weight_version(self, label):
            calls.append(("label", label))

        async def reset_prefix_cache(self, **kw):
            return True

    stream = StreamEngine(engine=Engine(), version=3)
    stream._labelled = True
    stream._flights["r1"] = _Flight(StreamResult("r1", [1]), {3: 3})

    async def broken():
        raise BrokenWeights("bucket 2 failed to load; rollback failed too")

    with pytest.raises(BrokenWeights):
        asyncio.run(stream.refit(broken, 4, "recompute"))
    assert calls == [("pause", "keep"), ("abort", ["r1"]), ("resume",)]  # nothing ran on the broken weights
    with pytest.raises(RuntimeError, match="stopped serving: bucket 2"):
        asyncio.run(stream.generate("r2", [1, 2], {"max_tokens": 2}))

    async def whole():
        calls.append(("load",))

    del stream._flights["r1"]
    record = asyncio.run(stream.refit(whole, 4, "recompute"))  # whole weights: serving again
    assert record.version == 4 and stream.version == 4 and stream._broken is None


class _PausedEngine:
    """Test double of AsyncLLM's pause/resume around a refit; `dies` kills it while paused (in the load)."""

    def __init__(self):
        self.errored, self.calls = False, []

    async def pause_generation(self, mode, clear_cache):
        self.calls.append(("pause", mode))

    async def resume_generation(self):
        if self.errored:
            raise RuntimeError("EngineDeadError: resume on a dead engine")
        self.calls.append(("resume",))


@pytest.mark.parametrize("dies", [False, True])
def test_a_failed_load_resumes_a_live_engine_and_reports_the_load_error_of_a_dead_one(dies):
    from megatron_rl.rollout.stream_engine import StreamResult, _Flight

    engine = _PausedEngine()
    stream = StreamEngine(engine=None)
    stream.engine, stream._labelled = engine, True
    stream._flights["r1"] = _Flight(StreamResult("r1", [1]), {0: 0})  # in flight: the refit pauses

    async def load():
        engine.errored = dies  # the engine core was killed while paused (drill refit_engine_death)
        raise RuntimeError("EngineDeadError: load failed" if dies else "bucket 3: checksum mismatch")

    with pytest.raises(RuntimeError, match="load failed" if dies else "checksum mismatch"):
        asyncio.run(stream.refit(load, 1, "recompute"))
    assert engine.calls == ([("pause", "keep")] if dies else [("pause", "keep"), ("resume",)])
    assert stream.version == 0 and stream._serving.is_set()  # nothing swapped; admissions not left waiting


class _RecordingEngine:
    """Test double of AsyncLLM: records the pause, resume, label and reset calls a refit or a roll back makes."""

    errored = False

    def __init__(self):
        self.calls = []

    async def pause_generation(self, **kw):
        self.calls.append(("pause", kw["mode"]))

    async def resume_generation(self):
        self.calls.append(("resume",))

    async def update_weight_version(self, label):
        self.calls.append(("label", label))

    async def reset_prefix_cache(self, **kw):
        self.calls.append(("reset", kw))
        return True


@pytest.mark.parametrize("in_flight", [0, 2])
def test_a_refit_pauses_the_engine_only_when_requests_are_in_flight(in_flight):
    # With nothing in flight no engine step can sample between the load and the label (admissions wait for
    # the refit), so vLLM's pause -- two calls and 20 ms of sleep -- is skipped; the rest of the refit is the same.
    from megatron_rl.rollout.stream_engine import StreamResult, _Flight

    engine = _RecordingEngine()
    calls = engine.calls
    stream = StreamEngine(engine=engine, version=1, label="1")
    stream._labelled = True
    for n in range(in_flight):
        stream._flights[f"r{n}"] = _Flight(StreamResult(f"r{n}", [1]), {1: 1})

    async def load():
        calls.append(("load",))

    record = asyncio.run(stream.refit(load, 2, "recompute"))
    swap = [("load",), ("label", "2"), ("reset", {"reset_running_requests": True})]
    assert calls == ([("pause", "keep")] + swap + [("resume",)] if in_flight else swap)
    assert (stream.version, record.in_flight, record.prefix_cache_reset) == (2, in_flight, True)
    assert stream._serving.is_set()


def test_a_roll_back_reloads_relabels_and_recomputes_the_kv_of_requests_in_flight():
    # A refused refit check (rollout/stream_actor.py) puts the version before back while requests run.
    from megatron_rl.rollout.stream_engine import StreamResult, _Flight

    engine = _RecordingEngine()
    calls = engine.calls
    stream = StreamEngine(engine=engine, version=4, label="4:new")
    stream._labelled = True
    stream._flights["r1"] = _Flight(StreamResult("r1", [1]), {3: 3, 4: 4})

    async def reload():
        calls.append(("reload",))

    record = asyncio.run(stream.roll_back(reload, 3, "3:old"))
    assert calls == [("pause", "keep"), ("reload",), ("label", "3:old"),
                     ("reset", {"reset_running_requests": True}), ("resume",)]
    assert (stream.version, stream.label, record.in_flight, record.prefix_cache_reset) == (3, "3:old", 1, True)
    assert stream._serving.is_set()


def test_the_streaming_actor_stays_threaded():
    # One `async def` method and Ray runs every method of the actor on one event loop, one call at a time:
    # a publication could then never land while a generate call runs.
    import inspect

    from megatron_rl.rollout.stream_actor import StreamRolloutWorker

    coroutines = [name for name, f in inspect.getmembers(StreamRolloutWorker, inspect.isfunction)
                  if inspect.iscoroutinefunction(f)]
    assert coroutines == []


@pytest.mark.parametrize("keeps", ["follows", "adapter"])
def test_what_a_request_keeps_decides_its_adapter_and_its_tokens_versions(keeps):
    """stream_engine.generate asks the request's `keeps` (publish/vllm_adapters.py), never whether the run has
    adapters: a full-weights request's tokens carry the versions vLLM labelled (one refit mid-response here),
    a LoRA request's are its adapter's version throughout, with its own KV."""
    from megatron_rl.publish.vllm_adapters import FOLLOWS_REFITS, KeepsAdapter

    seen = {}

    class Engine:  # test double of AsyncLLM.generate: one finished output whose spans cross a refit 3 -> 4
        async def generate(self, prompt, params, request_id, lora_request=None):
            seen["lora_request"] = lora_request
            spans = [SimpleNamespace(version="3", start=0, end=2), SimpleNamespace(version="4", start=2, end=4)]
            yield SimpleNamespace(finished=True, num_cached_tokens=0, outputs=[SimpleNamespace(
                token_ids=[5, 6, 7, 8], logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in (5, 6, 7, 8)],
                finish_reason="stop", weight_versions=spans)])

    stream = StreamEngine(engine=Engine(), version=3)
    stream._labelled = True
    held = FOLLOWS_REFITS if keeps == "follows" else KeepsAdapter("lora-3", "3:abc")

    async def run():
        stream._flights.clear()
        return await stream.generate("r", [1, 2], {"max_tokens": 4}, held)

    if keeps == "follows":
        with pytest.raises(RuntimeError, match="did not commit while the request was in flight"):
            asyncio.run(run())  # version 4 was never committed here: provenance unknown, refused
        return
    result = asyncio.run(run())
    assert seen["lora_request"] == "lora-3" and result.labels == [("3:abc", 0, 4)]
    assert [(s.start, s.end, s.version, s.kv_version) for s in result.segments] == [(0, 4, 3, 3)]
