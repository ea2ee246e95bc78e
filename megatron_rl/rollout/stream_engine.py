"""StreamEngine: vLLM's AsyncLLM with in-flight refits and per-token provenance (issue 27, engine side).

    engine = StreamEngine.start(RolloutConfig(model="/tmp/tiny", dtype="float32", weight_transfer="none"))
    result = await engine.generate("r1", prompt_tokens, {"max_tokens": 64, "temperature": 0.0})
    # meanwhile, in another task, while requests are in flight:
    record = await engine.refit(load, version=1, mode="recompute")   # load: async callable, all or nothing
    result.segments  # [Segment(start, end, version, kv_version)] over the response tokens

What vLLM 0.32 does across a refit (measured: experiments/kv_refit_findings.md, tests/e2e/test_stream_refit.py):
- `pause_generation(mode="keep", clear_cache=False)` freezes running requests with their KV blocks;
  after new weights and `resume_generation()` they continue on the KV the OLD weights computed.
- `reset_prefix_cache()` then returns False and does nothing (blocks are held by running requests):
  finished requests' old-weight blocks stay in the prefix cache, and a new request with the same
  prefix reuses them.
- `reset_prefix_cache(reset_running_requests=True)` preempts every running request (its KV freed,
  recomputed from prompt + tokens so far when scheduled again) and empties the prefix cache, or
  raises; `pause_generation(mode="keep", clear_cache=True)` does the same at pause time.

So a refit here is: pause (keep) -> load -> label -> invalidate -> resume (with nothing in flight, no pause:
admissions wait for the refit, so no engine step runs between load and label), in one of three modes:
- "recompute": every kept request's KV is recomputed under the new weights (the reset must
  succeed, else StaleCacheError and the engine stays paused: nothing stale is served).
- "keep_kv": kept requests continue on their old KV (as PipelineRL); their later tokens are
  recorded with the older `kv_version`.
- "wait": admissions wait while the requests in flight run to their end under the old weights; the
  swap then happens with nothing running (today's round semantics, without the rounds).
In all three, no request is aborted and no token is lost, and a request admitted after the refit never
reuses a block computed for an earlier admission version: every request carries its admission
version as vLLM's `cache_salt`, which is part of its blocks' hashes.

Provenance: vLLM labels every step's outputs with the weight version set while paused
(`update_weight_version`) and returns `CompletionOutput.weight_versions` spans; a Segment adds the
KV epoch: the oldest weights that computed part of the KV the token attended to (conservative for
a request admitted but not yet scheduled at a keep_kv refit).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from megatron_rl.fault_hooks import drill_spec, maybe_kill_engine_in_refit, record_injection
from megatron_rl.publish.vllm_adapters import FOLLOWS_REFITS, FollowsRefits, KeepsAdapter
from megatron_rl.rollout.config import REFIT_MODES, RefitMode, RolloutConfig
from megatron_rl.rollout.engine_setup import engine_env, llm_kwargs
from megatron_rl.rollout.occupancy import Occupancy, RunningFeed
from megatron_rl.rollout.requests import SAMPLING_KEYS, sampled_logprobs

log = logging.getLogger(__name__)

WORKER_EXTENSION = "megatron_rl.rollout.stream_worker.StreamWorkerExtension"  # loaded inside vLLM


class StaleCacheError(RuntimeError):
    """vLLM did not drop the old weights' KV in a "recompute" refit: the engine stays paused."""


class BrokenWeights(RuntimeError):
    """A refit's load failed and the old weights could not be restored either: the requests in flight
    are aborted (nothing runs on those weights) and the engine serves nothing until a refit loads whole
    weights."""


@dataclass(frozen=True)
class Segment:
    """Response tokens [start, end) sampled by weights `version`, attending to KV of which the oldest
    part was computed by weights `kv_version` (== version: no older KV)."""

    start: int
    end: int
    version: int
    kv_version: int


@dataclass
class StreamResult:
    """One finished request: its tokens, the logprobs the sampler used [T], and their provenance."""

    request_id: str
    prompt_tokens: list[int]
    response_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    segments: list[Segment] = field(default_factory=list)
    num_cached_tokens: int = 0
    """Prompt tokens vLLM took from its prefix cache at admission."""
    labels: list[tuple[str, int, int]] = field(default_factory=list)
    """vLLM's weights labels over the response, as (label, start, end) spans."""


@dataclass(frozen=True)
class RefitRecord:
    """What one refit did: the version it committed, its mode, the requests kept across it, whether
    vLLM's prefix cache was emptied, and how long generation stood still."""

    version: int
    mode: str
    in_flight: int
    prefix_cache_reset: bool
    load_s: float
    paused_s: float


@dataclass
class _Flight:
    """Book-keeping of one request in flight: its result so far and its KV epoch per version."""

    result: StreamResult
    kv_epoch: dict[int, int]  # weights version -> oldest version of the KV its tokens attend to


class StreamEngine:
    """One AsyncLLM: `generate` streams requests, `refit` swaps weights between two steps."""

    def __init__(self, engine, version: int = 0, label: str | None = None, feed: RunningFeed | None = None):
        """`engine`: a started vllm AsyncLLM serving policy `version` (StreamEngine.start builds one);
        `label`: what vLLM stamps on the tokens these weights sample ("<version>" unless given; its part
        before the first ":" is the version); `feed`: the engine's scheduler counts, for the occupancy."""
        self.engine = engine
        self._tokens_so_far = getattr(engine, "tokens_so_far", None)
        """An engine that counts a request's tokens itself (the stepped one): one output per request, at its end."""
        self.version = int(version)
        self.label = label if label is not None else str(int(version))
        self._flights: dict[str, _Flight] = {}
        self._refit_lock = asyncio.Lock()
        self._serving = asyncio.Event()  # cleared while a refit runs: admissions wait for its version
        self._serving.set()
        self._labelled = False
        self._broken: RuntimeError | None = None  # StaleCacheError: serve nothing more; BrokenWeights: until a refit
        self.occupancy = Occupancy(_capacity(engine))
        """Running requests over time against the engine's max_num_seqs (rollout/occupancy.py)."""
        if feed is not None:
            feed.attach(self.occupancy)

    @classmethod
    def start(cls, cfg: RolloutConfig, version: int = 0, label: str | None = None) -> "StreamEngine":
        """Build the engine from a rollout config (the same arguments as RolloutWorker's LLM).  AsyncLLM
        runs its engine core (and, "mp", its worker) in child processes; `engine_in_process` puts all of it
        in this process instead: vLLM's LLMEngine stepped by a thread (rollout/stepped_engine.py)."""
        import torch
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from megatron_rl.rollout.stepped_engine import SteppedEngine

        if not cfg.model or not os.path.isdir(cfg.model):
            raise FileNotFoundError(f"rollout.model: no checkpoint directory {cfg.model}")
        on_gpu = torch.cuda.is_available()
        os.environ.update(engine_env(cfg, on_gpu))
        kwargs = {**llm_kwargs(cfg, on_gpu), "worker_extension_cls": WORKER_EXTENSION}
        kwargs.update(cfg.engine_options)
        started = time.perf_counter()
        feed = RunningFeed()
        if cfg.engine_in_process:
            engine = SteppedEngine.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=[feed.factory()])
        else:
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=[feed.factory()])
        log.info("vLLM async engine for %s up in %.1f s", cfg.model, time.perf_counter() - started)
        return cls(engine, version, label, feed)

    def in_flight(self) -> dict[str, int]:
        """Request id -> response tokens received so far, for every request not finished."""
        if self._tokens_so_far is not None:
            return {rid: self._tokens_so_far(rid) for rid in list(self._flights)}
        return {rid: len(f.result.response_tokens) for rid, f in self._flights.items()}

    async def generate(self, request_id: str, prompt: list[int], sampling: dict[str, Any] | None = None,
                       keeps: FollowsRefits | KeepsAdapter = FOLLOWS_REFITS) -> StreamResult:
        """Run one request to its end across any refits; its tokens, behaviour logprobs and segments.
        `keeps`: what the request keeps to its end (publish/vllm_adapters.py): nothing (full weights: it
        follows the refits), or a LoRA run's adapter, which decides its tokens' versions and its KV's."""
        unknown = sorted(set(sampling or {}) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"unknown sampling key {unknown[0]!r}; allowed: {list(SAMPLING_KEYS)}")
        if request_id in self._flights:
            raise ValueError(f"request {request_id!r} is already in flight")
        await self._ensure_label()
        await self._serving.wait()
        if self._broken is not None:
            raise RuntimeError(f"this engine stopped serving: {self._broken}")
        from vllm.sampling_params import RequestOutputKind as Kind, SamplingParams

        # FINAL_ONLY: the whole response, logprobs and version spans at once, not one output per engine step.
        kind = Kind.FINAL_ONLY if self._tokens_so_far is not None else Kind.DELTA
        params = SamplingParams(logprobs=0, flat_logprobs=True, detokenize=False, output_kind=kind,
                                **(sampling or {}))
        # No await from here to the registration: a refit sees this request with this admission version.
        admitted = self.version
        flight = _Flight(StreamResult(request_id, list(prompt)), {admitted: admitted})
        self._flights[request_id] = flight
        self.occupancy.change(len(self._flights))
        result = flight.result
        # The admission version salts the request's block hashes: it shares no block of another version.
        prompt_in = {"prompt_token_ids": list(prompt), "cache_salt": f"v{admitted}"}
        try:
            async for out in self.engine.generate(prompt_in, params, request_id,
                                                  lora_request=keeps.lora_request):
                c = out.outputs[0]
                result.response_tokens.extend(c.token_ids)
                result.logprobs.extend(sampled_logprobs(c.logprobs, c.token_ids))
                result.num_cached_tokens = out.num_cached_tokens or 0
                if out.finished:
                    result.finish_reason = c.finish_reason
                    spans = keeps.spans(c.weight_versions, len(result.response_tokens))
                    result.labels = [(str(w.version), int(w.start), int(w.end)) for w in spans or []]
                    result.segments = _segments(spans, len(result.response_tokens),
                                                keeps.kv_epoch(flight.kv_epoch))
        finally:
            self._flights.pop(request_id, None)
            self.occupancy.change(len(self._flights))
        return result

    async def refit(self, load: Callable[[], Awaitable[Any]], version: int, mode: str = "recompute",
                    label: str | None = None) -> RefitRecord:
        """Swap in policy `version` while requests are in flight (module docstring).  `load()` puts the
        new weights into every engine worker or raises having changed nothing (a checked publication's
        all-or-nothing commit); on a raise generation resumes on the old weights and the error propagates."""
        if mode not in REFIT_MODES:
            raise ValueError(f"rollout.inflight_refit {mode!r} is not one of {list(REFIT_MODES)}")
        if int(version) <= self.version:
            raise ValueError(f"refit to version {version}: the engine already serves version {self.version}")
        await self._ensure_label()
        async with self._refit_lock:
            if isinstance(self._broken, StaleCacheError) or int(version) <= self.version:
                raise RuntimeError(f"refit to version {version} refused: {self._broken or 'a newer one came first'}")
            self._serving.clear()
            try:
                self._broken = None if isinstance(self._broken, BrokenWeights) else self._broken
                record = await self._refit_paused(load, int(version), mode,
                                                  label if label is not None else str(int(version)))
            except StaleCacheError as err:
                self._broken = err
                raise
            finally:
                self._serving.set()
        cache = "emptied" if record.prefix_cache_reset else REFIT_MODES[mode].kept_cache
        log.info("refit to version %d (%s): %d request(s) kept, prefix cache %s, paused %.3f s", version, mode,
                 record.in_flight, cache, record.paused_s)
        return record

    async def _refit_paused(self, load: Callable[[], Awaitable[Any]], version: int, mode: str,
                            label: str) -> RefitRecord:
        paused, how = time.perf_counter(), REFIT_MODES[mode]
        # Nothing in flight (admission waits on _serving, cleared by the caller): no step can sample a token
        # between load and label, so the engine is not paused -- vLLM's pause costs two calls and 20 ms of sleep.
        pause = bool(self._flights)
        if pause:
            await self._pause(how.pause)
        maybe_kill_engine_in_refit(version, len(self._flights))  # drill hook (refit_engine_death); else a no-op
        loading = time.perf_counter()
        try:
            await load()
        except BrokenWeights as err:  # neither the new weights nor the old are whole: nothing runs on them
            self._broken = err
            if self._flights:
                await self.engine.abort(list(self._flights))
            if pause:
                await self._resume_if_alive()
            raise
        except BaseException:
            if pause:
                await self._resume_if_alive()
            raise
        load_s = time.perf_counter() - loading
        await self.engine.update_weight_version(label)  # the label of every output from here on
        self.label = label
        reset = await self._invalidate(how, version)
        kept = list(self._flights.values())
        for f in kept:  # the oldest KV each kept request attends to from here on
            f.kv_epoch[version] = version if how.invalidate == "recompute" else f.kv_epoch[self.version]
        self.version = version
        if pause:
            await self.engine.resume_generation()
        return RefitRecord(version, mode, len(kept), reset, load_s, time.perf_counter() - paused)

    async def _pause(self, mode: str = "keep") -> None:
        """Pause generation (module docstring); a scheduler-fed occupancy reads 0 until vLLM steps again."""
        await self.engine.pause_generation(mode=mode, clear_cache=False)
        self.occupancy.paused()

    async def _resume_if_alive(self) -> None:
        """Resume generation; an engine that died while paused cannot, and the error of what ran says why."""
        if self.engine.errored:
            log.warning("refit: the vLLM engine died while paused; its %d request(s) in flight fail with it",
                        len(self._flights))
            return
        await self.engine.resume_generation()

    async def paused(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """`await call()` with generation paused (keep: requests in flight keep their KV), no refit beside it;
        a LoRA run's engine closes a weight update session so (vLLM empties its adapter cache then, and the
        adapters of requests in flight must be back before the next step)."""
        async with self._refit_lock:
            await self._pause()
            try:
                return await call()
            finally:
                await self._resume_if_alive()

    async def _invalidate(self, how: RefitMode, version: int) -> bool:
        """Drop old-weight KV as `how` asks; True when vLLM's prefix cache is now empty."""
        if how.invalidate == "none":
            return False
        if how.invalidate == "reset":  # succeeds when no request holds blocks; the salt protects the rest
            return bool(await self.engine.reset_prefix_cache())
        stale = drill_spec("stale_kv")  # `megatron-rl drill refit_stale_kv`: the bug the audit must catch
        if stale is not None and version >= int(stale.get("at_version", 1)):
            record_injection(stale, version=version, in_flight_requests=len(self._flights))
            return True
        try:
            reset = await self.engine.reset_prefix_cache(reset_running_requests=True)
        except Exception as err:  # noqa: BLE001 -- vLLM raises when a preempted request's blocks stay held
            raise StaleCacheError(f"vLLM could not drop the old weights' KV ({err!r}); the engine stays paused "
                                  "with the new weights loaded: abort its requests or shut it down") from err
        if reset is not True:
            raise StaleCacheError("vLLM did not reset its prefix cache after preempting the running requests "
                                  f"(returned {reset!r}); the engine stays paused with the new weights loaded")
        return True

    async def relabel(self, label: str) -> None:
        """Stamp the tokens sampled from now on with `label` (same weights, same version: e.g. a
        provisional label confirmed by a check)."""
        self._labelled = True
        await self.engine.update_weight_version(label)
        self.label = label

    async def roll_back(self, reload: Callable[[], Awaitable[Any]], version: int, label: str) -> RefitRecord:
        """Go back to the weights of `version` (older than the serving one) while requests are in flight:
        pause (keep), `reload()` them, recompute every kept request's KV, label, resume."""
        async with self._refit_lock:
            self._serving.clear()
            try:
                paused = time.perf_counter()
                await self._pause()
                try:
                    await reload()
                finally:
                    await self.engine.update_weight_version(label)
                    self.label = label
                    self.version = int(version)
                    for f in self._flights.values():
                        f.kv_epoch.setdefault(self.version, self.version)
                    try:
                        reset = await self._invalidate(REFIT_MODES["recompute"], self.version)
                    except StaleCacheError as err:
                        self._broken = err
                        raise
                    await self.engine.resume_generation()
            finally:
                self._serving.set()
        return RefitRecord(int(version), "rollback", len(self._flights), reset, 0.0, time.perf_counter() - paused)

    async def forget(self, label: str) -> None:
        """Serve no version of a run any more (an engine handed to the next run): the next refit may
        bring any version; nothing in flight may remain."""
        if self._flights:
            raise RuntimeError(f"{len(self._flights)} request(s) still in flight: cannot hand the engine over")
        await self.engine.reset_prefix_cache()
        self.version = -1
        await self.relabel(label)

    async def _ensure_label(self) -> None:
        """Label the engine's outputs with our label once (vLLM's default label is "default")."""
        if not self._labelled:
            self._labelled = True
            await self.engine.update_weight_version(self.label)

    def shutdown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()


def _capacity(engine) -> int:
    """The sequences the engine runs at once (its scheduler's max_num_seqs); 1 for an engine without a config."""
    config = getattr(engine, "vllm_config", None)
    return int(getattr(getattr(config, "scheduler_config", None), "max_num_seqs", 1) or 1)


def _segments(spans, num_tokens: int, kv_epoch: dict[int, int]) -> list[Segment]:
    """vLLM's weight-version spans over the response [(label, start, end)] with each one's KV epoch."""
    if not num_tokens:
        return []
    if not spans:
        raise RuntimeError("vLLM returned no weight-version spans for a finished request: provenance unknown")
    out = []
    for span in spans:
        head = str(span.version).split(":", 1)[0]
        version = int(head) if head.isdigit() else None
        if version not in kv_epoch:
            raise RuntimeError(f"tokens {span.start}-{span.end} carry weight version {span.version!r}, which this "
                               "engine did not commit while the request was in flight: provenance unknown")
        out.append(Segment(span.start, span.end, version, kv_epoch[version]))
    if out[0].start != 0 or out[-1].end != num_tokens or any(a.end != b.start for a, b in zip(out, out[1:])):
        raise RuntimeError(f"vLLM's weight-version spans {out} do not tile the {num_tokens} response tokens")
    return out
