"""What vLLM 0.32 does with the KV cache across an in-flight refit, proven on the CPU engine (issue 27).

    python -m pytest tests/e2e/test_stream_refit.py -q

One AsyncLLM (a StreamEngine) for the module.  Two tiny random llamas, A and B, take turns as the
new weights.  Requests (greedy, 64 tokens) are paused in "keep" mode after ~8 tokens, the other
model is loaded, and the logprobs vLLM reports for the tokens after the refit are compared with two
transformers references over the same tokens:
- fresh: every position computed by the new model (the prefix's KV recomputed);
- stale: positions [0, k) computed by the old model, the rest by the new one, k being the tokens
  whose KV existed at the pause (prompt + tokens sampled before it, less the last one).
The references differ by far more than 0.1 on these models, and vLLM agrees with one of them
within 1e-4: which one says what happened to the KV.  experiments/kv_refit_findings.md has numbers.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

from megatron_rl.models.tiny import make_tiny_model
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.stream_engine import Segment, StreamEngine
from tests.reference import fresh_logprobs, stale_logprobs

# An AsyncLLM made in the pytest process leaves a zmq context that, when the garbage collector finalizes
# it later, blocks in zmq_ctx_term for ever (seen in CI: the suite hung in a later test).  Until the
# engine is run in its own process here, this module runs only on request, in a pytest of its own:
#   MEGATRON_RL_STREAM_TESTS=1 python -m pytest tests/e2e/test_stream_refit.py -q
pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(not os.environ.get("MEGATRON_RL_STREAM_TESTS"),
                                 reason="AsyncLLM in the pytest process hangs a later GC (zmq); run it on its own "
                                        "with MEGATRON_RL_STREAM_TESTS=1")]

PROMPT_LEN, MAX_TOKENS, PAUSE_AFTER, BLOCK = 40, 64, 8, 32
SAME, DIFFERENT = 1e-4, 0.1  # |Δ logprob| for "this reference" / the references' own distance


class Rig:
    """The shared engine, the two checkpoints, their transformers twins and which one is serving."""

    def __init__(self, loop, stream, dirs, models):
        self.loop, self.stream, self.dirs, self.models = loop, stream, dirs, models
        self.serving = "A"

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def swap(self):
        """(old, new, load): `load()` puts the other checkpoint into the engine."""
        old, new = self.serving, "B" if self.serving == "A" else "A"

        async def load():
            await self.stream.engine.collective_rpc("megatron_rl_load_checkpoint", args=(self.dirs[new],))
            self.serving = new

        return old, new, load


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("stream_refit")
    dirs = {name: str(make_tiny_model(root / name, arch="llama", seed=seed)) for name, seed in (("A", 0), ("B", 1))}
    models = {n: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for n, d in dirs.items()}
    saved_env = dict(os.environ)
    loop = asyncio.new_event_loop()
    cfg = RolloutConfig(model=dirs["A"], dtype="float32", max_model_len=256, weight_transfer="none",
                        engine_in_process=True, engine_options={"block_size": BLOCK, "enable_prefix_caching": True})

    async def start():
        return StreamEngine.start(cfg)

    stream = loop.run_until_complete(start())
    try:
        yield Rig(loop, stream, dirs, models)
    finally:
        stream.shutdown()
        loop.close()
        os.environ.clear()
        os.environ.update(saved_env)


def prompts(case: int, n: int = 3) -> list[list[int]]:
    """n distinct prompts of PROMPT_LEN tokens, different for every case (no prefix-cache crosstalk)."""
    rng = random.Random(case)
    return [[1] + [rng.randrange(5, 95) for _ in range(PROMPT_LEN - 1)] for _ in range(n)]


GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}


def deltas(rig, prompt, tokens, logprobs, g: int, old: str, new: str, k: int | None = None) -> tuple[float, float]:
    """max |Δ| of vLLM's logprobs of response tokens [g, N) against the fresh and the stale reference."""
    seq, n = list(prompt) + list(tokens), len(prompt)
    got = torch.tensor(logprobs[g:], dtype=torch.float64)
    fresh = fresh_logprobs(rig.models[new], seq)[n - 1 + g:]
    k = n + g - 1 if k is None else k
    stale = stale_logprobs(rig.models[old], rig.models[new], seq, k)[n + g - 1 - k:]
    return float((got - fresh).abs().max()), float((got - stale).abs().max())


async def in_flight_refit(stream: StreamEngine, rids, ps, refit):
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


def test_keep_mode_continues_on_old_kv_and_plain_reset_is_refused(rig):
    """pause(keep, clear_cache=False) + new weights + resume: the kept requests attend to the KV the old
    weights computed; reset_prefix_cache() meanwhile returns False and changes nothing."""
    engine = rig.stream.engine
    old, new, load = rig.swap()

    async def case():
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
        return ps, refused, out

    ps, refused, out = rig.run(case())
    assert refused is False, "vLLM reset its prefix cache with requests holding blocks: re-check keep-mode refits"
    for prompt, (tokens, lps, spans, _) in zip(ps, out):
        assert [s[0] for s in spans] == ["raw-old", "raw-new"] and spans[-1][2] == MAX_TOKENS
        fresh, stale = deltas(rig, prompt, tokens, lps, spans[1][1], old, new)
        assert stale <= SAME and fresh > DIFFERENT, f"expected the old weights' KV: fresh {fresh:.3g}, stale {stale:.3g}"


def test_finished_requests_old_blocks_are_reused_by_a_new_request_without_reset(rig):
    """Without a reset, a new request with the same prompt takes the old weights' blocks from the prefix cache."""
    engine = rig.stream.engine
    (prompt,) = prompts(2, n=1)

    async def case():
        await raw_generate(engine, "raw-prefix-0", prompt, {})
        old, new, load = rig.swap()
        await engine.pause_generation(mode="keep", clear_cache=False)
        await load()
        await engine.resume_generation()
        return old, new, await raw_generate(engine, "raw-prefix-1", prompt, {})

    old, new, (tokens, lps, _, cached) = rig.run(case())
    assert cached == BLOCK, f"expected one {BLOCK}-token block from the prefix cache, got {cached}"
    fresh, stale = deltas(rig, prompt, tokens, lps, 0, old, new, k=BLOCK)
    assert stale <= SAME and fresh > DIFFERENT, f"expected the cached block's old KV: fresh {fresh:.3g}, stale {stale:.3g}"


# ---- StreamEngine: the refit modes ------------------------------------------------------------------

def _check_segments(results, v0: int, v1: int, kv_after: int) -> list[int]:
    """Every request has two segments, v0 then v1 (KV epoch kv_after); returns the boundaries."""
    bounds = []
    for r in results:
        g = r.segments[0].end
        assert 0 < g < MAX_TOKENS and len(r.response_tokens) == len(r.logprobs) == MAX_TOKENS
        assert r.segments == [Segment(0, g, v0, v0), Segment(g, MAX_TOKENS, v1, kv_after)], r.segments
        bounds.append(g)
    return bounds


@pytest.mark.parametrize("mode", ["recompute", "keep_kv"])
def test_refit_modes(rig, mode):
    """recompute: the tokens after the refit are those of a full recompute under the new weights;
    keep_kv: those of the old KV, and the segments say so.  No request is lost or cut short."""
    stream = rig.stream
    v0, (old, new, load) = stream.version, rig.swap()
    ps = prompts(3 if mode == "recompute" else 4)
    rids = [f"{mode}-{i}" for i in range(len(ps))]
    record, results = rig.run(in_flight_refit(stream, rids, ps, lambda: stream.refit(load, v0 + 1, mode)))
    assert (record.version, record.mode, record.in_flight) == (v0 + 1, mode, len(ps))
    assert record.prefix_cache_reset is (mode == "recompute")
    bounds = _check_segments(results, v0, v0 + 1, v0 + 1 if mode == "recompute" else v0)
    for p, r, g in zip(ps, results, bounds):
        fresh, stale = deltas(rig, p, r.response_tokens, r.logprobs, g, old, new)
        want, other = (fresh, stale) if mode == "recompute" else (stale, fresh)
        assert want <= SAME and other > DIFFERENT, f"{mode}: fresh {fresh:.3g}, stale {stale:.3g}"


def test_new_request_never_reuses_an_older_versions_blocks(rig):
    """A keep_kv refit cannot empty the prefix cache (a request holds blocks): a new request with the
    prompt of one finished before the refit still computes everything under the new weights."""
    stream = rig.stream
    (prompt,), v0 = prompts(5, n=1), stream.version

    async def case():
        await stream.generate("salt-before", prompt, GREEDY)
        old, new, load = rig.swap()
        record, _ = await in_flight_refit(stream, ["salt-hold"], prompts(6, n=1),
                                          lambda: stream.refit(load, v0 + 1, "keep_kv"))
        return old, new, record, await stream.generate("salt-after", prompt, GREEDY)

    old, new, record, after = rig.run(case())
    assert not record.prefix_cache_reset
    assert after.num_cached_tokens == 0 and after.segments == [Segment(0, MAX_TOKENS, v0 + 1, v0 + 1)]
    fresh, stale = deltas(rig, prompt, after.response_tokens, after.logprobs, 0, old, new, k=BLOCK)
    assert fresh <= SAME and stale > DIFFERENT, f"fresh {fresh:.3g}, stale {stale:.3g}"


def test_a_reset_that_does_nothing_is_caught(rig, monkeypatch):
    """The bug peers shipped, injected: a reset that reports success and does nothing.  The recompute
    check above would then fail: the tokens after the refit match the stale reference, not the fresh one."""
    stream = rig.stream

    async def silent_reset(*args, **kwargs):
        return True

    monkeypatch.setattr(stream.engine, "reset_prefix_cache", silent_reset)
    v0, (old, new, load) = stream.version, rig.swap()
    ps = prompts(7, n=2)
    _, results = rig.run(in_flight_refit(stream, ["silent-0", "silent-1"], ps,
                                         lambda: stream.refit(load, v0 + 1, "recompute")))
    for p, r, g in zip(ps, results, _check_segments(results, v0, v0 + 1, v0 + 1)):
        fresh, stale = deltas(rig, p, r.response_tokens, r.logprobs, g, old, new)
        assert fresh > DIFFERENT and stale <= SAME, f"fresh {fresh:.3g}, stale {stale:.3g}"


def test_a_failed_load_resumes_on_the_old_weights(rig):
    """load() raises: generation resumes, the version stays, every token is the old weights' own."""
    stream = rig.stream
    v0, serving = stream.version, rig.serving

    async def broken():
        raise OSError("publication broke off")

    ps = prompts(8, n=2)
    err, results = rig.run(in_flight_refit(stream, ["broken-0", "broken-1"], ps, lambda: stream.refit(broken, v0 + 1)))
    assert isinstance(err, OSError) and stream.version == v0 and rig.serving == serving
    for p, r in zip(ps, results):
        assert r.segments == [Segment(0, MAX_TOKENS, v0, v0)]
        fresh = fresh_logprobs(rig.models[serving], list(p) + r.response_tokens)[len(p) - 1:]
        assert float((torch.tensor(r.logprobs, dtype=torch.float64) - fresh).abs().max()) <= SAME
