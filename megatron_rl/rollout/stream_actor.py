"""StreamRolloutWorker: a rollout group that streams and takes publications in flight (issue 27).

    worker = create_stream_worker(RolloutConfig(model=..., streaming=True, inflight_refit="recompute"))
    refs = [worker.generate.remote([prompt], {"seed": s}, 4) for prompt, s in groups]   # all at once

RolloutWorker's contract (rollout/worker.py: generate, score, reset, shutdown; and the receiving part both
hold, rollout/receiver.py: receive_weights / commit_weights, expect_probe, policy_version, ...), on vLLM's
async engine (a StreamEngine, rollout/stream_engine.py) instead of the offline `LLM`.  The actor is threaded:
many generate calls run at once, each one's requests joining the engine's continuous batch, and a publication
runs beside them instead of queueing behind them.

A publication, step by step:
- receive: the bytes arrive and are verified into staging buffers (publish/vllm_engine.py) while the
  requests in flight keep their KV; vLLM runs the transfer between two engine steps.
- swap: StreamEngine.refit pauses (keep), loads the staged tensors (all or nothing: a worker that fails
  to load rolls every worker back before anything runs), invalidates old KV as rollout.inflight_refit
  says, labels the new weights and resumes.
- check: the refit check (engine vs learner logprobs on the probe, rollout/refit_check.py) needs a running
  engine, so it runs right after resume while the new weights carry a provisional label
  "<version>:<digest>:u<n>".  Passed: the label becomes "<version>:<digest>" and provisional tokens count as
  that version.  Refused: the group goes back to the old weights in flight (their KV recomputed), and
  every request that sampled a token under the refused weights fails with `RefusedWeights`; the fleet
  sends it again with the same seed (rollout/fleet.py), so no such token reaches the queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
import uuid
from typing import Any

from megatron_rl.publish.vllm_adapters import ServedAdapters
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine_close import quiesce
from megatron_rl.rollout.engine_setup import eos_token_ids, prepare_actor
from megatron_rl.rollout.provenance import parse_label, weights_label
from megatron_rl.rollout.receiver import PublicationReceiving
from megatron_rl.rollout.requests import call_params, check_prompts, prompt_params, to_sample
from megatron_rl.rollout.stream_engine import BrokenWeights

log = logging.getLogger(__name__)

PROVISIONAL = ":u"  # "<version>:<digest>:u<n>": weights loaded, refit check n not yet passed


class RefusedWeights(RuntimeError):
    """A request sampled tokens under weights whose refit check then failed: send it again."""


class _Blocking:
    """The offline LLM's weight-update calls, run on the async engine's loop (what the receiving part calls)."""

    def __init__(self, worker: "StreamRolloutWorker"):
        self._w = worker

    def start_weight_update(self) -> None:
        self._w._run(self._w.stream.engine.start_weight_update())

    def update_weights(self, request: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._w._run(self._w.stream.engine.update_weights(WeightTransferUpdateRequest(**request)))

    def finish_weight_update(self) -> None:
        self._w._run(_finish_update_session(self._w.stream, self._w.adapters.session_calls()))

    def init_weight_transfer_engine(self, request: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._w._run(self._w.stream.engine.init_weight_transfer_engine(WeightTransferInitRequest(**request)))

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return self._w._run(self._w.stream.engine.collective_rpc(method, args=args))

    def reset_prefix_cache(self) -> bool:
        return bool(self._w._run(self._w.stream.engine.reset_prefix_cache()))


class StreamRolloutWorker(PublicationReceiving):
    """One vLLM async engine behind RolloutWorker's methods; generate calls run concurrently.  Publications are
    received by the part it holds (rollout/receiver.py); it supplies the swap (`_commit`: in flight)."""

    def __init__(self, config: RolloutConfig | dict, stale: bool = False):
        """`stale`: a restarted group, serving nothing until a publication commits (as RolloutWorker's)."""
        self.config = RolloutConfig.of(config)
        prepare_actor(self.config)
        if not self.config.model or not os.path.isdir(self.config.model):
            raise FileNotFoundError(f"rollout.model: no checkpoint directory {self.config.model}")
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="stream-engine-loop", daemon=True).start()
        self.version = None if stale else 0
        self.label = weights_label(self.version, None)
        self._checks = itertools.count()
        self._verdicts: dict[int, tuple[threading.Event, list[bool]]] = {}
        self._probe = None
        self._kept = [0, 0]  # since the last occupancy(): refits committed, requests kept in flight across them
        started = time.perf_counter()
        self.stream = self._run(_start_engine(self.config, -1 if stale else 0, self.label))
        self.llm = _Blocking(self)
        self.adapters = ServedAdapters(self.config.adapter)  # a LoRA run: versions are adapters on the base
        self.adapters.start(self.llm, self.config.model)
        self._adapter_label = self.label  # a LoRA run: the committed version's label, the adapter new requests get
        self.eos_token_ids = eos_token_ids(self.config.model)
        log.info("vLLM async engine for %s (TP=%d, in-flight refit %s) up in %.1f s", self.config.model,
                 self.config.tensor_parallel_size, self.config.inflight_refit, time.perf_counter() - started)

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def reset(self, config: RolloutConfig | dict) -> None:
        """Hand this engine to the next run (train/engine_pool.py): stale until its first publication."""
        from megatron_rl.rollout.engine_setup import engine_identity

        new = RolloutConfig.of(config)
        if engine_identity(new, False) != engine_identity(self.config, False):
            raise ValueError(f"rollout engine for {self.config.model} cannot serve {new.model}: the engine "
                             "arguments or the model's shapes differ")
        self.config, self.version, self._probe = new, None, None
        self.eos_token_ids = eos_token_ids(new.model)
        self.label = self._adapter_label = weights_label(None, None)
        self.adapters = ServedAdapters(new.adapter)
        self.adapters.start(self.llm, new.model)
        self._run(self.stream.forget(self.label))

    # ---- generation -------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: dict[str, Any] | None = None, n: int = 1,
                 info: list | None = None) -> list:
        """RolloutWorker.generate's contract (len(prompts) * n samples, prompt-major; with a `seed`, sample j
        of prompt i uses seed + i * n + j); the requests join whatever else the engine runs."""
        check_prompts(prompts)
        params = call_params(self.config, self.eos_token_ids, len(prompts), sampling, n, info)
        self._serving_version()
        call = uuid.uuid4().hex[:12]
        adapter = self._adapter()
        jobs = []
        for i, prompt in enumerate(prompts):
            own = prompt_params(params, info, i)
            for j in range(n):
                seed = None if own["seed"] is None else own["seed"] + i * n + j
                jobs.append((f"{call}-{i}-{j}", prompt, {**own, "seed": seed}))
        results = self._run(_gather(self.stream, jobs, adapter))
        if any(result.finish_reason == "abort" for result, _, _ in results):  # a load that could not roll back
            raise RuntimeError("this rollout group holds no complete policy version (a failed load could not be "
                               "rolled back; its requests in flight were aborted): sent again")
        samples = []
        for (rid, _, used), (result, started, finished) in zip(jobs, results):
            i = int(rid.split("-")[1])
            sample = to_sample(result, {**used, "n": n}, started, finished, info[i] if info else None)
            sample.weights = self._checked_weights(result)
            samples.append(sample)
        return samples

    def run_episodes(self, examples: list, sampling: dict[str, Any] | None = None, n: int = 1,
                     info: list | None = None, env: dict | None = None) -> list:
        """n multi-turn episodes of each example (data Examples) with environment `env` (an EnvConfig as a
        dict), prompt-major and seeded as generate's samples; rollout/episodes.py plays them."""
        from megatron_rl.rollout.episodes import player_for

        params = call_params(self.config, self.eos_token_ids, len(examples), sampling, n, info)
        self._serving_version()
        player = player_for(env or {}, self.config.model, params["max_tokens"])
        return self._run(player.group(self.stream, uuid.uuid4().hex[:12], examples, params, n, info,
                                      self._checked_weights, self._adapter))

    def _adapter(self):
        """What a request admitted now keeps to its end (publish/vllm_adapters.py): a LoRA run's newest committed
        adapter, or nothing (full weights)."""
        return self.adapters.keeps(self._adapter_label, lambda label: int(parse_label(label)[0]))

    def _checked_weights(self, result) -> dict[str, str]:
        """{version: digest} of the weights that sampled the result's tokens; provisional labels wait for
        their refit check's verdict, and a refused one raises RefusedWeights."""
        weights: dict[str, str] = {}
        for label, start, end in result.labels:
            version, digest = parse_label(label)
            if PROVISIONAL in digest:
                digest, n = digest.rsplit(PROVISIONAL, 1)
                event, verdict = self._verdicts[int(n)]
                if not event.wait(self.config.publish_timeout_s) or not verdict[0]:
                    raise RefusedWeights(f"request {result.request_id}: tokens {start}..{end} were sampled by "
                                         f"version {version}'s weights, whose refit check failed; sent again")
            weights[str(version)] = digest
        return weights

    def score(self, sequences: list[list[int]], version: int | None = None) -> list[list[float | None]]:
        """Teacher-forced logprob of every token given its prefix (first is None) [T], on the weights
        serving now (salted apart from every cached block): the version being checked, when one is.  A LoRA
        run: under `version`'s adapter (installed, perhaps not committed yet), else the committed one's."""
        lora = (self.adapters.request(version, installed=True) if version is not None
                else self._adapter().lora_request)
        return self._run(_score(self.stream.engine, sequences, lora))

    def in_flight(self) -> int:
        """Requests generating on this engine now."""
        return len(self.stream.in_flight())

    def occupancy(self) -> dict[str, float]:
        """The engine's occupancy and idle fraction since the last call (rollout/occupancy.py), and the refits
        committed meanwhile with the requests they kept in flight."""
        (refits, kept), self._kept = self._kept, [0, 0]
        return {**self.stream.occupancy.take(), "refits": refits, "requests_kept": kept}

    # ---- weight publication (receive side) ----------------------------------------------
    def engine_alive(self) -> bool:
        return not self.stream.engine.errored

    def engine_world_size(self) -> int:
        return self.stream.engine.vllm_config.parallel_config.world_size

    def _model_config(self):
        return self.stream.engine.vllm_config.model_config

    def _commit(self, version: int, statuses: list[dict[str, Any]]) -> dict[str, Any]:
        """All or nothing, in flight: swap (StreamEngine.refit), then the refit check on the running engine."""
        bad = [s for s in statuses if not s.get("ok")]
        digest = statuses[0].get("digest") if statuses else None
        again = not bad and self.version is not None and int(version) <= self.version
        if again:  # the last version again (a restarted group's refit reaches every group): nothing to swap
            same = int(version) == self.version and self.label == weights_label(version, digest)
            bad = [] if same else [{"ok": False, "error": f"publication {version} is older than the version "
                                    f"{self.version} this group serves, or differs from it"}]
        if bad or again:
            self.llm.collective_rpc("megatron_rl_drop_publication")
            self.llm.finish_weight_update()
            return self._answer(version, bad, statuses)
        n = next(self._checks)
        self._verdicts[n] = (threading.Event(), [False])
        failed: list[dict] = []

        async def load() -> None:  # runs paused (StreamEngine.refit)
            engine = self.stream.engine
            await engine.finish_weight_update()
            for call in self.adapters.session_calls():  # LoRA: vLLM emptied its adapter cache, the kept ones back
                await engine.collective_rpc(call)
            failed.extend(s for s in await engine.collective_rpc("megatron_rl_publication_status")
                          if not s.get("committed"))
            if failed:  # some worker did not load: every worker goes back before anything runs
                back = await engine.collective_rpc("megatron_rl_rollback_publication")
                if any(not r["ok"] for r in back):
                    self.version = None  # requests in flight are aborted and sent again (generate)
                    raise BrokenWeights(f"{failed[0].get('error')}; rollback failed too")
                raise RuntimeError(failed[0].get("error"))

        before, before_label = self.version, self.label
        try:
            mode = self.config.refit_mode
            record = self._run(self.stream.refit(load, version, mode,
                                                 label=f"{weights_label(version, digest)}{PROVISIONAL}{n}"))
        except RuntimeError as err:
            self._verdicts[n][0].set()
            if not failed:
                raise
            log.warning("load of version %d failed (%s): %s", version, err,
                        "serving nothing until a publication commits" if self.version is None else
                        f"rolled back to version {before}")
            return self._answer(version, failed, statuses)
        self.version = int(version)
        refused = self._refit_check(version)
        if refused:
            self._run(self.stream.roll_back(lambda: _reload_previous(self.stream.engine), before, before_label))
            self.version, self.label = before, before_label
            self._verdicts[n][0].set()
            return self._answer(version, [refused], statuses)
        self.llm.collective_rpc("megatron_rl_accept_publication", args=(self.config.keep_rollback_copy,))
        self.label = weights_label(version, digest)
        self._run(self.stream.relabel(self.label))
        self.adapters.committed(self.version)
        self._adapter_label = self.label  # a LoRA run: requests admitted from now on get this version's adapter
        self._verdicts[n][1][0] = True
        self._verdicts[n][0].set()
        self._kept = [self._kept[0] + 1, self._kept[1] + record.in_flight]
        return self._answer(version, [], statuses)

    def _set_label(self, digest: str | None) -> None:
        self.label = weights_label(self.version, digest)
        self._run(self.stream.relabel(self.label))

    def shutdown(self) -> None:
        stream, self.stream = getattr(self, "stream", None), None
        if stream is not None:
            try:
                self._run(quiesce(stream), timeout=60)  # vLLM's output handler stops first (rollout/engine_close.py)
            finally:
                stream.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)


# Coroutines of the actor live outside its class: Ray turns a class with any `async def` method into an
# async actor, whose (blocking) methods would then run one at a time on Ray's event loop.

async def _start_engine(cfg: RolloutConfig, version: int, label: str):
    from megatron_rl.rollout.stream_engine import StreamEngine

    return StreamEngine.start(cfg, version, label)  # on the loop its client will use


async def _finish_update_session(stream, after: tuple[str, ...]) -> None:
    """Close vLLM's weight update session, then run the workers' calls `after` it (ServedAdapters.session_calls).
    The session empties vLLM's adapter cache: a LoRA run's engine closes it paused and puts its kept adapters
    back before a step runs (requests in flight name them)."""
    engine = stream.engine
    if not after:
        return await engine.finish_weight_update()

    async def close() -> None:
        await engine.finish_weight_update()
        for call in after:
            await engine.collective_rpc(call)

    return await stream.paused(close)


async def _gather(stream, jobs: list, keeps) -> list:
    async def one(rid: str, prompt: list[int], params: dict):
        started = time.time()
        result = await stream.generate(rid, prompt, params, keeps)
        return result, started, time.time()

    return await asyncio.gather(*(one(*job) for job in jobs))


async def _score(engine, sequences: list[list[int]], lora=None) -> list:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0)
    salt = f"score-{uuid.uuid4().hex}"

    async def one(k: int, seq: list[int]):
        last = None
        async for out in engine.generate({"prompt_token_ids": seq, "cache_salt": salt}, params, f"{salt}-{k}",
                                         lora_request=lora):
            last = out
        return [None] + [float(lp[t].logprob) for lp, t in zip(last.prompt_logprobs[1:], seq[1:])]

    return list(await asyncio.gather(*(one(k, s) for k, s in enumerate(sequences))))


async def _reload_previous(engine) -> None:
    back = await engine.collective_rpc("megatron_rl_rollback_publication")
    if any(not r["ok"] for r in back):
        raise RuntimeError(f"rollback after a refused refit check failed: {back}")


def create_stream_worker(config: RolloutConfig, stale: bool = False, **ray_options):
    """Start a StreamRolloutWorker Ray actor (threaded: its generate calls run at once); returns its handle."""
    import dataclasses

    import ray

    from megatron_rl.platform.priority import with_normal_priority

    options = with_normal_priority({"num_cpus": config.num_cpus, "max_concurrency": 256, **ray_options})
    return ray.remote(StreamRolloutWorker).options(**options).remote(dataclasses.asdict(config), stale)
