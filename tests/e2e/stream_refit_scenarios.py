"""The engine side of tests/e2e/test_stream_refit.py, run in a process of its own.

    python -m tests.e2e.stream_refit_scenarios DIR_A DIR_B OUT.json

Starts one StreamEngine (an AsyncLLM) on checkpoint A, runs every scenario of the test module in
order, each swapping A and B in as the new weights, and writes what each measured (tokens, logprobs,
weight-version spans, refit records) to OUT.json; the tests compare those with transformers
references in the pytest process.  Why a process: an AsyncLLM leaves a zmq context behind whose
finalizer, when the garbage collector reaches it, can block in zmq_ctx_term for ever (it hung a later
test module of the suite).  Here the results are written, the engine shut down, and the process
ends with os._exit: no finalizer runs, and the pytest process never holds vLLM state.

A scenario that raises is recorded as {"error": traceback} and the next one still runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import traceback

PROMPT_LEN, MAX_TOKENS, PAUSE_AFTER, BLOCK = 40, 64, 8, 32
PAUSE_S = 0.5  # how long the occupancy scenario's refit keeps the engine paused
EPISODES_AT_ONCE = 24  # more than the 16 threads EpisodePlayer once shared between all its episodes
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}


def prompts(case: int, n: int = 3) -> list[list[int]]:
    """n distinct prompts of PROMPT_LEN tokens, different for every case (no prefix-cache crosstalk)."""
    rng = random.Random(case)
    return [[1] + [rng.randrange(5, 95) for _ in range(PROMPT_LEN - 1)] for _ in range(n)]


class Rig:
    """The engine, the two checkpoints and which one is serving."""

    def __init__(self, stream, dirs):
        self.stream, self.dirs = stream, dirs
        self.serving = "A"

    def swap(self):
        """(old, new, load): `load()` puts the other checkpoint into the engine."""
        old, new = self.serving, "B" if self.serving == "A" else "A"

        async def load():
            await self.stream.engine.collective_rpc("megatron_rl_load_checkpoint", args=(self.dirs[new],))
            self.serving = new

        return old, new, load


def as_json(result) -> dict:
    """A StreamResult as plain data (segments as [start, end, version, kv_version])."""
    return {"response_tokens": list(result.response_tokens), "logprobs": list(result.logprobs),
            "num_cached_tokens": result.num_cached_tokens,
            "segments": [[s.start, s.end, s.version, s.kv_version] for s in result.segments]}


def record_json(record) -> dict:
    return {"version": record.version, "mode": record.mode, "in_flight": record.in_flight,
            "prefix_cache_reset": record.prefix_cache_reset}


async def in_flight_refit(stream, rids, ps, refit):
    """Start the requests, run `refit()` once one has PAUSE_AFTER tokens; (refit's result or error, results)."""
    tasks = [asyncio.create_task(stream.generate(r, p, GREEDY)) for r, p in zip(rids, ps)]
    while max(stream.in_flight().values(), default=0) < PAUSE_AFTER:
        await asyncio.sleep(0.002)
    assert len(stream.in_flight()) == len(rids), "a request finished before the refit: nothing was in flight"
    try:
        done = await refit()
    except Exception as err:  # noqa: BLE001 -- returned for the test to check
        done = err
    return done, await asyncio.gather(*tasks)


# ---- raw vLLM: what the engine does by itself -------------------------------------------------------

async def raw_generate(engine, rid: str, prompt: list[int], seen: dict):
    """vLLM's own generate (no salt): (tokens, logprobs, [(label, start, end)], num_cached_tokens)."""
    from vllm import SamplingParams

    params = SamplingParams(logprobs=0, detokenize=False, **GREEDY)
    async for out in engine.generate({"prompt_token_ids": prompt}, params, rid):
        c = out.outputs[0]
        seen[rid] = len(c.token_ids)
    lps = [float(lp[t].logprob) for lp, t in zip(c.logprobs, c.token_ids)]
    return list(c.token_ids), lps, [(s.version, s.start, s.end) for s in c.weight_versions], out.num_cached_tokens


async def keep_raw(rig: Rig) -> dict:
    """pause(keep, clear_cache=False) + new weights + resume, with a plain reset while paused."""
    engine = rig.stream.engine
    old, new, load = rig.swap()
    seen: dict = {}
    ps = prompts(1)
    await engine.update_weight_version("raw-old")
    tasks = [asyncio.create_task(raw_generate(engine, f"raw-keep-{i}", p, seen)) for i, p in enumerate(ps)]
    while max(seen.values(), default=0) < PAUSE_AFTER:
        await asyncio.sleep(0.002)
    await engine.pause_generation(mode="keep", clear_cache=False)
    refused = await engine.reset_prefix_cache()
    await load()
    await engine.update_weight_version("raw-new")
    await engine.resume_generation()
    out = await asyncio.gather(*tasks)
    await engine.update_weight_version(str(rig.stream.version))
    return {"old": old, "new": new, "prompts": ps, "refused": refused, "out": out}


async def prefix_reuse(rig: Rig) -> dict:
    """A finished request's prompt again after a refit, no reset in between."""
    engine = rig.stream.engine
    (prompt,) = prompts(2, n=1)
    await raw_generate(engine, "raw-prefix-0", prompt, {})
    old, new, load = rig.swap()
    await engine.pause_generation(mode="keep", clear_cache=False)
    await load()
    await engine.resume_generation()
    tokens, lps, _, cached = await raw_generate(engine, "raw-prefix-1", prompt, {})
    return {"old": old, "new": new, "prompt": prompt, "tokens": tokens, "logprobs": lps, "cached": cached}


# ---- StreamEngine: the refit modes ------------------------------------------------------------------

async def refit_mode(rig: Rig, mode: str) -> dict:
    stream = rig.stream
    v0, (old, new, load) = stream.version, rig.swap()
    ps = prompts(3 if mode == "recompute" else 4)
    rids = [f"{mode}-{i}" for i in range(len(ps))]
    record, results = await in_flight_refit(stream, rids, ps, lambda: stream.refit(load, v0 + 1, mode))
    return {"v0": v0, "old": old, "new": new, "prompts": ps, "record": record_json(record),
            "results": [as_json(r) for r in results]}


async def salted(rig: Rig) -> dict:
    """A keep_kv refit with a request holding blocks, then a finished request's prompt again."""
    stream = rig.stream
    (prompt,), v0 = prompts(5, n=1), stream.version
    await stream.generate("salt-before", prompt, GREEDY)
    old, new, load = rig.swap()
    record, _ = await in_flight_refit(stream, ["salt-hold"], prompts(6, n=1),
                                      lambda: stream.refit(load, v0 + 1, "keep_kv"))
    after = await stream.generate("salt-after", prompt, GREEDY)
    return {"v0": v0, "old": old, "new": new, "prompt": prompt, "record": record_json(record),
            "after": as_json(after)}


async def silent_reset(rig: Rig) -> dict:
    """A recompute refit whose prefix-cache reset reports success and does nothing (injected)."""
    stream = rig.stream
    real = stream.engine.reset_prefix_cache

    async def does_nothing(*args, **kwargs):
        return True

    stream.engine.reset_prefix_cache = does_nothing
    try:
        v0, (old, new, load) = stream.version, rig.swap()
        ps = prompts(7, n=2)
        _, results = await in_flight_refit(stream, ["silent-0", "silent-1"], ps,
                                           lambda: stream.refit(load, v0 + 1, "recompute"))
    finally:
        stream.engine.reset_prefix_cache = real
    return {"v0": v0, "old": old, "new": new, "prompts": ps, "results": [as_json(r) for r in results]}


async def failed_load(rig: Rig) -> dict:
    """load() raises in the middle of a refit."""
    stream = rig.stream
    v0, serving = stream.version, rig.serving

    async def broken():
        raise OSError("publication broke off")

    ps = prompts(8, n=2)
    err, results = await in_flight_refit(stream, ["broken-0", "broken-1"], ps, lambda: stream.refit(broken, v0 + 1))
    return {"v0": v0, "serving_before": serving, "serving_after": rig.serving, "version_after": stream.version,
            "error_is_oserror": isinstance(err, OSError), "error": repr(err), "prompts": ps,
            "results": [as_json(r) for r in results]}


async def occupancy(rig: Rig) -> dict:
    """The engine's occupancy over three windows: requests generating, a refit's pause (the load waits
    PAUSE_S with the requests kept), and the rest of the requests after it."""
    stream, windows = rig.stream, {}
    v0, (_, _, load) = stream.version, rig.swap()

    async def slow_load():
        windows["generating"] = stream.occupancy.take()
        await asyncio.sleep(PAUSE_S)
        windows["paused"] = stream.occupancy.take()
        await load()

    stream.occupancy.take()  # a new window
    ps = prompts(12)
    await in_flight_refit(stream, [f"occ-{i}" for i in range(len(ps))], ps,
                          lambda: stream.refit(slow_load, v0 + 1, "recompute"))
    windows["after"] = stream.occupancy.take()
    return {"source": stream.occupancy.source, "capacity": stream.occupancy.capacity, "requests": len(ps),
            "windows": windows}


async def groups_in_completion_order(rig: Rig) -> dict:
    """groups_as_completed on the engine: group 0 has one long sample, the later groups are short."""
    from megatron_rl.rollout.stream_groups import groups_as_completed

    lengths = [[4, 64], [4, 4], [4, 4]]
    order = []

    def sampling(g, s):
        return {**GREEDY, "max_tokens": lengths[g][s]}

    async for g, samples in groups_as_completed(rig.stream, prompts(9), sampling, group_size=2, capacity=6,
                                                prefix="group"):
        order.append({"group": g, "lengths": [len(x.response_tokens) for x in samples],
                      "versions": [sorted(set(x.policy_versions)) for x in samples]})
    return {"version": rig.stream.version, "lengths": lengths, "order": order}


async def episode_across_refit(rig: Rig) -> dict:
    """A two-turn episode (rollout/episodes.py) whose environment step waits while the weights change:
    its second turn is a new request on the new weights, the first stays the old weights' own."""
    import dataclasses
    import threading

    from megatron_rl.envs.config import EnvConfig
    from megatron_rl.envs.protocol import Environment, StepResult
    from megatron_rl.envs.registry import ENVIRONMENTS, register_environment
    from megatron_rl.rollout.episodes import EpisodePlayer
    from megatron_rl.rollout.sample import PromptInfo

    loop, wanted, refitted = asyncio.get_running_loop(), asyncio.Event(), threading.Event()

    @dataclasses.dataclass(kw_only=True)
    class GateConfig:
        pass

    class Gate(Environment):  # a test environment: its first step holds until the refit is done
        name = "refit_gate"
        observation_role = "user"

        def __init__(self, config):
            self.steps = 0

        def reset(self, example) -> str:
            return example

        def step(self, action: str) -> StepResult:
            self.steps += 1
            if self.steps == 1:
                loop.call_soon_threadsafe(wanted.set)
                assert refitted.wait(120), "the refit never came"
                return StepResult("go on")
            return StepResult("", reward=1.0, done=True)

    if "refit_gate" not in ENVIRONMENTS:
        register_environment(Gate, GateConfig)
    v0, (old, new, load) = rig.stream.version, rig.swap()
    player = EpisodePlayer(EnvConfig(name="refit_gate", chat_template="plain", max_total_tokens=200),
                           rig.dirs[old], max_tokens_per_turn=12)
    params = {"temperature": 0.0, "ignore_eos": True, "seed": None}
    task = asyncio.create_task(player.one(rig.stream, "episode", "count to ten", params, PromptInfo(), lambda r: {}))
    await wanted.wait()
    record = await rig.stream.refit(load, v0 + 1, "recompute")
    refitted.set()
    sample = await task
    return {"v0": v0, "old": old, "new": new, "record": record_json(record), "prompt": sample.prompt_tokens,
            "response_tokens": sample.response_tokens, "logprobs": sample.behavior_logprobs,
            "versions": sample.policy_versions, "mask": sample.action_mask, "segments": sample.segments,
            "episode": dataclasses.asdict(sample.episode)}


async def episodes_step_at_once(rig: Rig) -> dict:
    """EPISODES_AT_ONCE episodes whose first environment step waits until every one of them is in its step
    (a barrier): they end done only if no episode's step waits for a thread another episode's step holds."""
    import dataclasses
    import threading

    from megatron_rl.envs.config import EnvConfig
    from megatron_rl.envs.protocol import Environment, StepResult
    from megatron_rl.envs.registry import ENVIRONMENTS, register_environment
    from megatron_rl.rollout.episodes import EpisodePlayer

    barrier = threading.Barrier(EPISODES_AT_ONCE, timeout=30)

    @dataclasses.dataclass(kw_only=True)
    class BarrierConfig:
        pass

    class AllAtOnce(Environment):  # a test environment: a tool that returns once every episode called it
        name = "all_at_once"

        def __init__(self, config):
            pass

        def reset(self, example) -> str:
            return example

        def step(self, action: str) -> StepResult:
            barrier.wait()  # BrokenBarrierError after 30 s: env_error
            return StepResult("", reward=1.0, done=True)

    if "all_at_once" not in ENVIRONMENTS:
        register_environment(AllAtOnce, BarrierConfig)
    player = EpisodePlayer(EnvConfig(name="all_at_once", chat_template="plain", max_total_tokens=200,
                                     step_timeout_s=60), rig.dirs[rig.serving], max_tokens_per_turn=4)
    examples = [f"tool call {i}" for i in range(EPISODES_AT_ONCE)]
    samples = await player.group(rig.stream, "at-once", examples, {**GREEDY, "max_tokens": 4}, 1,
                                 None, lambda r: {})
    return {"episodes": [dataclasses.asdict(s.episode) for s in samples]}


SCENARIOS = {  # in the order the tests are written: each swaps A and B
    "keep_raw": keep_raw,
    "prefix_reuse": prefix_reuse,
    "refit_recompute": lambda rig: refit_mode(rig, "recompute"),
    "refit_keep_kv": lambda rig: refit_mode(rig, "keep_kv"),
    "salted": salted,
    "silent_reset": silent_reset,
    "failed_load": failed_load,
    "occupancy": occupancy,
    "groups": groups_in_completion_order,
    "episode": episode_across_refit,
    "episodes_at_once": episodes_step_at_once,
}


async def run_all(dirs: dict[str, str]) -> dict:
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.stream_engine import StreamEngine

    cfg = RolloutConfig(model=dirs["A"], dtype="float32", max_model_len=256, weight_transfer="none",
                        engine_in_process=True, engine_options={"block_size": BLOCK, "enable_prefix_caching": True})
    stream = StreamEngine.start(cfg)
    rig, out = Rig(stream, dirs), {}
    try:
        for name, scenario in SCENARIOS.items():
            try:
                out[name] = await scenario(rig)
            except Exception:  # noqa: BLE001 -- the test of this scenario fails with it
                out[name] = {"error": traceback.format_exc()}
    finally:
        stream.shutdown()
    return out


def main(argv: list[str]) -> None:
    dir_a, dir_b, path = argv
    code = 1
    try:
        results = asyncio.run(run_all({"A": dir_a, "B": dir_b}))
        with open(path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(path + ".tmp", path)
        code = 0
    except BaseException:  # noqa: BLE001 -- reported, then the hard exit below
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no garbage collection of vLLM's zmq context at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1:])
