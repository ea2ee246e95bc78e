"""SteppedEngine (rollout/stepped_engine.py): vLLM's LLMEngine stepped by one thread behind AsyncLLM's calls.

The engine here is a test double of LLMEngine that samples one token per running request per step, each
token labelled with the weight version set at that step; the real engine is driven by the e2e refit
scenarios (tests/e2e/test_stream_refit.py) and every streaming run of the tiny recipes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from megatron_rl.rollout.stepped_engine import EngineDead, SteppedEngine


class _State:
    def __init__(self, rid: str, max_tokens: int):
        self.rid, self.max_tokens, self.tokens, self.versions = rid, max_tokens, [], []
        self.detokenizer = SimpleNamespace(num_output_tokens=lambda: len(self.tokens))

    def make_request_output(self, new_token_ids, pooling_output, finish_reason, stop_reason):
        return _output(self, str(finish_reason).lower().split(".")[-1])


def _output(state: _State, reason: str | None):
    return SimpleNamespace(request_id=state.rid, finished=reason is not None,
                           outputs=[SimpleNamespace(token_ids=list(state.tokens), finish_reason=reason,
                                                    versions=list(state.versions))])


class FakeLLMEngine:
    """One token per running request per step; a step can be made to fail or to take a while."""

    def __init__(self, step_s: float = 0.0):
        self.vllm_config = None
        self.output_processor = SimpleNamespace(request_states={})
        self.engine_core = SimpleNamespace(shutdown=lambda: self.events.append(("shutdown",)))
        self.version, self.steps, self.step_s, self.fail_at = "0", 0, step_s, None
        self.events: list[tuple] = []
        self.thread_ids: set[int] = set()

    def _on_thread(self):
        self.thread_ids.add(threading.get_ident())

    def add_request(self, rid, prompt, params, lora_request=None):
        self._on_thread()
        iid = f"{rid}-internal"
        self.output_processor.request_states[iid] = _State(rid, params["max_tokens"])
        self.events.append(("add", rid))
        return iid

    def has_unfinished_requests(self):
        return bool(self.output_processor.request_states)

    def step(self):
        self._on_thread()
        self.steps += 1
        if self.fail_at == self.steps:
            raise RuntimeError("the engine core died")
        time.sleep(self.step_s)
        done = []
        for iid, state in list(self.output_processor.request_states.items()):
            state.tokens.append(self.steps)
            state.versions.append(self.version)
            if len(state.tokens) >= state.max_tokens:
                del self.output_processor.request_states[iid]
                done.append(_output(state, "length"))
        self.events.append(("step", self.version, len(done)))
        return done

    def abort_request(self, rids):
        self._on_thread()
        for rid in rids:
            self.output_processor.request_states.pop(f"{rid}-internal", None)
        self.events.append(("abort", tuple(rids)))

    def set_weight_version(self, version):
        self._on_thread()
        self.version = version
        self.events.append(("label", version))

    def reset_prefix_cache(self, reset_running_requests=False):
        self._on_thread()
        self.events.append(("reset", reset_running_requests))
        return not self.output_processor.request_states

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self._on_thread()
        self.events.append(("rpc", method, args))
        if method == "explode":
            raise OSError("the worker refused")
        return [f"{method} done"]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))  # a caller left waiting fails the test, not the suite


async def _until(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


async def _final(engine: SteppedEngine, rid: str, max_tokens: int):
    return [out async for out in engine.generate({"prompt_token_ids": [1]}, {"max_tokens": max_tokens}, rid)]


@pytest.fixture
def stepped():
    """stepped(step_s=...) -> (the fake LLMEngine, a SteppedEngine over it); every engine made is shut down."""
    made: list[SteppedEngine] = []

    def make(step_s: float = 0.0) -> tuple[FakeLLMEngine, SteppedEngine]:
        fake = FakeLLMEngine(step_s)
        made.append(SteppedEngine(fake))
        return fake, made[-1]

    yield make
    for engine in made:
        engine.shutdown()


def test_requests_run_to_their_end_and_calls_run_on_the_stepping_thread_between_steps(stepped):
    fake, engine = stepped()

    async def main():
        a = asyncio.create_task(_final(engine, "a", 5))
        b = asyncio.create_task(_final(engine, "b", 3))
        outs_a, outs_b = await a, await b
        rpc = await engine.collective_rpc("megatron_rl_status", args=(7,))
        return outs_a, outs_b, rpc

    outs_a, outs_b, rpc = _run(main())
    assert [len(o.outputs[0].token_ids) for o in outs_a + outs_b] == [5, 3]
    assert outs_a[-1].finished and outs_a[-1].outputs[0].finish_reason == "length"
    assert rpc == ["megatron_rl_status done"] and ("rpc", "megatron_rl_status", (7,)) in fake.events
    assert fake.thread_ids == {engine._thread.ident}  # the engine is only ever touched by its thread
    assert not fake.has_unfinished_requests() and engine.tokens_so_far("a") == 0
    engine.shutdown()
    assert fake.events[-1] == ("shutdown",) and engine.errored


def test_keep_pause_stops_steps_and_a_label_set_while_paused_marks_every_later_token(stepped):
    fake, engine = stepped(0.002)

    async def main():
        task = asyncio.create_task(_final(engine, "r", 40))
        await _until(lambda: engine.tokens_so_far("r") >= 5)
        await engine.pause_generation(mode="keep", clear_cache=False)
        at_pause, steps = engine.tokens_so_far("r"), fake.steps
        await asyncio.sleep(0.05)
        frozen = (engine.tokens_so_far("r"), fake.steps) == (at_pause, steps)
        await engine.collective_rpc("load")
        await engine.update_weight_version("1")
        await engine.resume_generation()
        return at_pause, frozen, (await task)[-1].outputs[0]

    at_pause, frozen, out = _run(main())
    assert frozen, "the engine stepped while paused"
    assert out.versions == ["0"] * at_pause + ["1"] * (40 - at_pause)


def test_wait_pause_returns_once_nothing_is_in_flight(stepped):
    fake, engine = stepped(0.002)

    async def main():
        task = asyncio.create_task(_final(engine, "r", 20))
        await _until(lambda: engine.tokens_so_far("r") >= 2)
        await engine.pause_generation(mode="wait", clear_cache=False)
        done_at_pause = task.done() or not fake.has_unfinished_requests()
        await engine.resume_generation()
        return done_at_pause, (await task)[-1]

    done_at_pause, last = _run(main())
    assert done_at_pause and len(last.outputs[0].token_ids) == 20 and last.outputs[0].finish_reason == "length"


def test_an_aborted_request_ends_with_its_tokens_so_far_and_abort(stepped):
    fake, engine = stepped(0.002)

    async def main():
        task = asyncio.create_task(_final(engine, "r", 1000))
        await _until(lambda: engine.tokens_so_far("r") >= 3)
        await engine.abort(["r"])
        return (await task)[-1]

    last = _run(main())
    assert last.finished and last.outputs[0].finish_reason == "abort" and len(last.outputs[0].token_ids) >= 3
    assert ("abort", ("r",)) in fake.events and not fake.has_unfinished_requests()


def test_a_caller_that_leaves_early_has_its_request_aborted(stepped):
    fake, engine = stepped(0.002)

    async def main():
        task = asyncio.create_task(_final(engine, "r", 1000))
        await _until(lambda: engine.tokens_so_far("r") >= 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: not fake.has_unfinished_requests())

    _run(main())
    assert ("abort", ("r",)) in fake.events


def test_a_failing_call_raises_in_its_caller_and_the_engine_goes_on(stepped):
    fake, engine = stepped()

    async def main():
        with pytest.raises(OSError, match="the worker refused"):
            await engine.collective_rpc("explode")
        return await _final(engine, "after", 2)

    assert len(_run(main())[-1].outputs[0].token_ids) == 2 and not engine.errored


def test_a_step_that_raises_fails_every_caller_in_flight_and_every_later_call(stepped):
    fake, engine = stepped(0.002)
    fake.fail_at = 4  # (no step runs before a request is added)

    async def main():
        tasks = [asyncio.create_task(_final(engine, rid, 100)) for rid in ("a", "b")]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        with pytest.raises(EngineDead, match="the engine core died"):
            await engine.collective_rpc("anything")
        return results

    results = _run(main())
    assert all(isinstance(r, EngineDead) and "the engine core died" in str(r) for r in results), results
    assert engine.errored and ("shutdown",) in fake.events


def test_bad_pause_mode_is_refused_by_name(stepped):
    _, engine = stepped()
    with pytest.raises(ValueError, match="pause mode 'drain'"):
        _run(engine.pause_generation(mode="drain"))


def test_calls_after_shutdown_fail_at_once_and_shutdown_is_idempotent(stepped):
    fake, engine = stepped()
    engine.shutdown()
    engine.shutdown()
    with pytest.raises(EngineDead, match="shut down"):
        _run(engine.collective_rpc("anything"))
    assert fake.events.count(("shutdown",)) == 1 and not any(e[0] == "rpc" for e in fake.events)


def test_a_built_engine_is_built_on_the_thread_that_steps_it():
    """OpenMP teams are per thread: an engine built on one thread and stepped on another ran its compute in a
    second team (rollout/stepped_engine.py, "One thread")."""
    built_on = []

    def build():
        built_on.append(threading.get_ident())
        return FakeLLMEngine()

    engine = SteppedEngine(build=build)
    try:
        outs = _run(_final(engine, "a", 4))
        assert len(outs[-1].outputs[0].token_ids) == 4
        assert built_on == [engine._thread.ident] != [threading.get_ident()]
        assert engine.engine.thread_ids == {engine._thread.ident}
    finally:
        engine.shutdown()


def test_a_build_that_raises_raises_in_the_constructor_and_leaves_no_thread():
    def build():
        raise OSError("no checkpoint")

    before = threading.active_count()
    with pytest.raises(OSError, match="no checkpoint"):
        SteppedEngine(build=build)
    deadline = time.monotonic() + 5
    while threading.active_count() > before:
        assert time.monotonic() < deadline, "the stepping thread outlived its failed build"
        time.sleep(0.01)
    with pytest.raises(ValueError, match="exactly one"):
        SteppedEngine(FakeLLMEngine(), build=FakeLLMEngine)
    with pytest.raises(ValueError, match="exactly one"):
        SteppedEngine()
