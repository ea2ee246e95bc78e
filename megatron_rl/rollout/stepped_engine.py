"""SteppedEngine: vLLM's LLMEngine in the rollout actor's own process, stepped by one thread, behind the
asyncio calls a StreamEngine makes of vLLM's AsyncLLM (issue 46).

    engine = SteppedEngine.from_engine_args(EngineArgs(**kwargs), stat_loggers=[feed.factory()])
    async for out in engine.generate({"prompt_token_ids": [...]}, params, "r1"):   # FINAL_ONLY: one output
        ...
    await engine.pause_generation(mode="keep"); await engine.collective_rpc("..."); await engine.resume_generation()

Why: AsyncLLM always runs vLLM's engine core in a child process and talks to it over ZMQ; its front end
(output handler, per-request collectors, stats) runs in the actor.  On 2 CPU cores beside a learner that
front end cost 0.31-0.34 ms of CPU per generated token on the tiny recipe, about a third of the engine
core's own, where the round engine (vllm.LLM, in process) pays none of it.  `rollout.engine_in_process`
now means the same for both engines: everything in the actor's process.

How: one thread owns the LLMEngine (it is not thread-safe).  Every call -- add a request, abort, pause,
label, reset the prefix cache, a collective RPC into the worker -- is queued to that thread and runs
between two engine steps, in the order it was made; the caller awaits its result.  The thread steps the
engine while it has unfinished requests and is not paused, and hands each output to its request's
stream on the caller's event loop.  Pause modes as AsyncLLM's: "keep" (requests stay, with their KV,
no step runs until resume), "wait" (steps go on until nothing is in flight, then no step runs) and
"abort" (requests in flight end with finish_reason "abort").  An aborted request's caller gets its
final output with what it has so far and finish_reason "abort", as AsyncLLM's callers do.  A step that
raises kills the engine: every caller in flight and every later call get that error (`errored`).

One thread builds the engine too (`from_engine_args`).  OpenMP gives every thread that starts a parallel
region a thread team of its own.  An engine built on one thread (its weights loaded, its profiling run
done) and stepped on another kept the first team idle beside the second; GNU OpenMP, counting more threads
than cores, then let the stepping team's workers sleep between parallel regions, and with 2 OpenMP threads
the engine used 1.1 cores, its steps 30% longer than the same engine stepped where it was built
(benchmarks/stream_throughput.md, session 42).  The rollout actors of a run on this machine get one OpenMP
thread, so it mattered for an engine given more (rollout.num_cpus >= 2, and the engine benchmark).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from typing import Any, AsyncIterator, Callable

log = logging.getLogger(__name__)

_STOP = object()


class EngineDead(RuntimeError):
    """The stepped engine's thread ended: a step raised, or the engine was shut down."""


class SteppedEngine:
    """An in-process vLLM LLMEngine with the asyncio face of AsyncLLM that StreamEngine uses (module doc)."""

    def __init__(self, engine=None, *, build: Callable[[], Any] | None = None):
        """`engine`: a vllm.v1.engine.llm_engine.LLMEngine built in process (VLLM_ENABLE_V1_MULTIPROCESSING=0);
        or `build`, which makes one on the stepping thread (from_engine_args does; why: the module doc, "One
        thread").  A build that raises raises here."""
        if (engine is None) == (build is None):
            raise ValueError("SteppedEngine takes an engine or a build function, exactly one")
        self._cond = threading.Condition()
        self._calls: collections.deque = collections.deque()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._internal: dict[str, str] = {}  # request id -> the id vLLM gave it (for an abort's last output)
        self._paused = False
        self._wait_idle: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._dead: BaseException | None = None
        failed: list[BaseException] = []  # what the build raised
        ready = threading.Event()

        def build_then_run():
            try:
                self.engine = engine if build is None else build()
                self.vllm_config = self.engine.vllm_config
            except BaseException as err:  # noqa: BLE001 -- raised in the constructor's thread below
                failed.append(err)
            ready.set()
            if not failed:
                self._run()

        self._thread = threading.Thread(target=build_then_run, name="vllm-stepper", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    @classmethod
    def from_engine_args(cls, engine_args, stat_loggers: list | None = None) -> "SteppedEngine":
        """Build the LLMEngine in this process, on the stepping thread, with `stat_loggers` its only stat
        loggers (vLLM's default ones would log throughput lines every few seconds and keep Prometheus
        counters per step)."""
        from vllm.v1.engine.llm_engine import LLMEngine

        def build():
            engine = LLMEngine.from_engine_args(engine_args, stat_loggers=stat_loggers, enable_multiprocessing=False)
            _keep_only(engine, stat_loggers or [])
            return engine

        return cls(build=build)

    # -- what StreamEngine and the streaming actor call (AsyncLLM's names) --------------------------------

    @property
    def errored(self) -> bool:
        return self._dead is not None

    async def generate(self, prompt: dict, params, request_id: str, lora_request=None) -> AsyncIterator[Any]:
        """The request's outputs (one, at its end, for FINAL_ONLY params), its last one `finished`."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already in flight")
        self._streams[request_id] = (loop, queue)
        finished = False
        try:
            await self._call(lambda: self._add(request_id, prompt, params, lora_request))
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = bool(out.finished)
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._dead is None:  # the caller left early (cancelled): the engine drops it
                self._post(lambda: self._abort([request_id]), None)

    def tokens_so_far(self, request_id: str) -> int:
        """Response tokens the request has sampled so far (0 before it is added or after it ended)."""
        state = self.engine.output_processor.request_states.get(self._internal.get(request_id, ""))
        detokenizer = getattr(state, "detokenizer", None)
        return detokenizer.num_output_tokens() if detokenizer is not None else 0

    async def abort(self, request_ids) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        await self._call(lambda: self._abort(ids))

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode {mode!r} is not one of abort, wait, keep")
        loop = asyncio.get_running_loop()
        idle = loop.create_future()

        def pause():
            if mode == "abort":
                self._abort(list(self._internal))
            if mode == "wait" and self.engine.has_unfinished_requests():
                self._wait_idle.append((loop, idle))  # the thread pauses when the last request ends
                return
            self._paused = True
            loop.call_soon_threadsafe(_settle, idle, None, None)

        await self._call(pause)
        await idle
        if clear_cache:
            await self.reset_prefix_cache()

    async def resume_generation(self) -> None:
        def resume():
            self._paused = False

        await self._call(resume)

    async def is_paused(self) -> bool:
        return self._paused

    async def update_weight_version(self, new_version: str) -> None:
        await self._call(lambda: self.engine.set_weight_version(new_version))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return await self._call(lambda: self.engine.reset_prefix_cache(reset_running_requests))

    async def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        return await self._call(lambda: self.engine.collective_rpc(method, timeout, args, kwargs))

    async def init_weight_transfer_engine(self, request) -> None:
        await self.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": request.init_info})

    async def start_weight_update(self) -> None:
        await self.collective_rpc("start_weight_update")

    async def update_weights(self, request) -> None:
        await self.collective_rpc("update_weights", kwargs={"update_info": request.update_info})

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.collective_rpc("finish_weight_update")
        if weight_version is not None:
            await self.update_weight_version(weight_version)

    def shutdown(self) -> None:
        """Stop stepping (callers in flight get EngineDead) and shut the engine core down; idempotent."""
        self._post(_STOP, None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)

    # -- the stepping thread ---------------------------------------------------------------------------------

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the stepping thread between two steps; its result or its exception."""
        if self._dead is not None:
            raise EngineDead(f"the vLLM engine is dead: {self._dead}")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._post(fn, (loop, done))
        return await done

    def _post(self, fn, reply) -> None:
        with self._cond:
            if self._dead is None:
                self._calls.append((fn, reply))
                self._cond.notify()
                return
        if reply is not None:  # the thread is gone (or going): nobody would run it
            reply[0].call_soon_threadsafe(_settle, reply[1], None, self._dead)

    def _stepping(self) -> bool:
        return not self._paused and self.engine.has_unfinished_requests()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._calls and not self._stepping():
                        self._cond.wait()
                    calls, self._calls = list(self._calls), collections.deque()
                for i, (fn, reply) in enumerate(calls):
                    if fn is _STOP:
                        self._die(EngineDead("the vLLM engine was shut down"), calls[i + 1:])
                        return
                    try:
                        result, error = fn(), None
                    except Exception as err:  # noqa: BLE001 -- handed to the caller, who raises it
                        result, error = None, err
                    if reply is not None:
                        reply[0].call_soon_threadsafe(_settle, reply[1], result, error)
                if self._stepping():
                    self._deliver(self.engine.step())
                if self._wait_idle and not self.engine.has_unfinished_requests():
                    self._paused = True
                    for loop, fut in self._wait_idle:
                        loop.call_soon_threadsafe(_settle, fut, None, None)
                    self._wait_idle.clear()
        except BaseException as err:  # noqa: BLE001 -- a dead engine fails every caller with why
            self._die(err, [])

    def _add(self, request_id: str, prompt: dict, params, lora_request) -> None:
        self._internal[request_id] = self.engine.add_request(request_id, prompt, params, lora_request=lora_request)

    def _deliver(self, outputs) -> None:
        for out in outputs:
            if out.finished:
                self._internal.pop(out.request_id, None)
            target = self._streams.get(out.request_id)
            if target is not None:
                target[0].call_soon_threadsafe(target[1].put_nowait, out)

    def _abort(self, request_ids: list[str]) -> None:
        """End the requests; each caller gets its last output (tokens so far, finish_reason "abort")."""
        from vllm.v1.engine import FinishReason

        last = []
        for rid in request_ids:
            state = self.engine.output_processor.request_states.get(self._internal.pop(rid, ""))
            if state is not None:
                last.append(state.make_request_output([], None, FinishReason.ABORT, None))
        self.engine.abort_request(request_ids)
        self._deliver([out for out in last if out is not None])

    def _die(self, err: BaseException, leftover: list) -> None:
        """Stop the engine core, then fail every caller waiting (`leftover`: calls taken off the queue, not run)."""
        with self._cond:  # from here on _post runs nothing: it answers with this error
            self._dead = err if isinstance(err, EngineDead) else EngineDead(f"a vLLM engine step failed: {err!r}")
            calls, self._calls = list(leftover) + list(self._calls), collections.deque()
        if not isinstance(err, EngineDead):
            log.error("the stepped vLLM engine died: %r", err)
        try:
            self.engine.engine_core.shutdown()
        except Exception as shut:  # noqa: BLE001 -- already dead; say so and go
            log.warning("shutting the vLLM engine core down: %r", shut)
        for _fn, reply in calls:
            if reply is not None:
                reply[0].call_soon_threadsafe(_settle, reply[1], None, self._dead)
        for loop, fut in self._wait_idle:
            loop.call_soon_threadsafe(_settle, fut, None, self._dead)
        for loop, queue in list(self._streams.values()):
            loop.call_soon_threadsafe(queue.put_nowait, self._dead)


def _settle(fut: asyncio.Future, result, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _keep_only(engine, factories: list) -> None:
    """Drop vLLM's default stat loggers (a throughput log line every few seconds, Prometheus counters per
    step): keep only the loggers `factories` made."""
    manager = getattr(engine, "logger_manager", None)
    if manager is None:
        return
    ours = tuple(f for f in factories if isinstance(f, type))

    def made_here(logger) -> bool:
        inner = getattr(logger, "per_engine_stat_loggers", {}) or {}
        return isinstance(logger, ours) or any(isinstance(x, ours) for x in inner.values())

    manager.stat_loggers = [x for x in manager.stat_loggers if made_here(x)]
