"""Measure what vLLM's AsyncLLM does with the KV cache across a refit, in every pause mode (issue 27).

    flock /tmp/mrl-heavy.lock python experiments/kv_refit_probe.py [--out DIR] > probe.jsonl

Findings: experiments/kv_refit_findings.md.  One AsyncLLM on CPU serves tiny random llama A; in each
scenario three greedy requests (40-token prompts, 96 tokens, distinct per scenario) are started, the
engine is paused after ~8 tokens, llama B (or A again) is loaded through rollout/stream_worker.py, and
generation resumes.  For the tokens after the refit it prints the max |Δ logprob| of vLLM's
logprobs against transformers' `fresh` (prefix recomputed under the new weights) and `stale`
(prefix KV from the old weights) references (tests/reference.py), what reset_prefix_cache returned,
the pause call's latency and the time from resume to each request's first new-version token.
The asserted subset of these facts is tests/e2e/test_stream_refit.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.models.tiny import make_tiny_model  # noqa: E402
from megatron_rl.rollout.config import RolloutConfig  # noqa: E402
from megatron_rl.rollout.stream_engine import StreamEngine  # noqa: E402
from tests.reference import fresh_logprobs, stale_logprobs  # noqa: E402

PROMPT_LEN, MAX_TOKENS, PAUSE_AFTER = 40, 96, 8
SCENARIOS = {  # name -> (pause_generation kwargs, what to call while paused after the load)
    "keep": (dict(mode="keep", clear_cache=False), None),
    "keep+reset": (dict(mode="keep", clear_cache=False), dict(reset_running_requests=False)),
    "keep+reset_running": (dict(mode="keep", clear_cache=False), dict(reset_running_requests=True)),
    "keep+clear_cache": (dict(mode="keep", clear_cache=True), None),
    "wait": (dict(mode="wait", clear_cache=True), None),
    "abort": (dict(mode="abort", clear_cache=True), None),
}


class Probe:
    def __init__(self, stream: StreamEngine, dirs: dict[str, str]):
        from transformers import AutoModelForCausalLM

        self.engine, self.dirs, self.serving = stream.engine, dirs, "A"
        self.models = {n: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for n, d in dirs.items()}

    async def load_other(self) -> tuple[str, str]:
        old, new = self.serving, "B" if self.serving == "A" else "A"
        await self.engine.collective_rpc("megatron_rl_load_checkpoint", args=(self.dirs[new],))
        self.serving = new
        return old, new

    async def request(self, rid: str, prompt: list[int], seen: dict, stamps: dict):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(logprobs=0, detokenize=False, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        tokens, lps, spans, cached, reason = [], [], [], 0, None
        async for out in self.engine.generate({"prompt_token_ids": prompt}, params, rid):
            c = out.outputs[0]
            if c.token_ids:
                stamps.setdefault(rid, []).append((time.perf_counter(), len(tokens)))
            tokens += c.token_ids
            lps += [float(lp[t].logprob) for lp, t in zip(c.logprobs or [], c.token_ids)]
            seen[rid], cached, reason = len(tokens), out.num_cached_tokens or 0, c.finish_reason
            spans = [(s.version, s.start, s.end) for s in c.weight_versions or []]
        return dict(tokens=tokens, lps=lps, spans=spans, cached=cached, finish=reason)

    def deltas(self, prompt, r, g: int, old: str, new: str, k: int | None = None) -> dict:
        seq, n = list(prompt) + r["tokens"], len(prompt)
        if g >= len(r["tokens"]):
            return {}
        got = torch.tensor(r["lps"][g:], dtype=torch.float64)
        k = n + g - 1 if k is None else k
        fresh = fresh_logprobs(self.models[new], seq)[n - 1 + g:]
        stale = stale_logprobs(self.models[old], self.models[new], seq, k)[n + g - 1 - k:]
        return dict(vs_fresh=float((got - fresh).abs().max()), vs_stale=float((got - stale).abs().max()))

    async def scenario(self, name: str, case: int) -> dict:
        pause_kw, reset_kw = SCENARIOS[name]
        rng = random.Random(case)
        ps = [[1] + [rng.randrange(5, 95) for _ in range(PROMPT_LEN - 1)] for _ in range(3)]
        await self.engine.update_weight_version(f"{case}-old")
        seen, stamps = {}, {}
        tasks = [asyncio.create_task(self.request(f"{name}-{i}", p, seen, stamps)) for i, p in enumerate(ps)]
        while max(seen.values(), default=0) < PAUSE_AFTER:
            await asyncio.sleep(0.002)
        t = time.perf_counter()
        await self.engine.pause_generation(**pause_kw)
        pause_s, at_pause = time.perf_counter() - t, dict(seen)
        old, new = await self.load_other()
        reset = await self.engine.reset_prefix_cache(**reset_kw) if reset_kw is not None else None
        await self.engine.update_weight_version(f"{case}-new")
        resumed = time.perf_counter()
        await self.engine.resume_generation()
        out = await asyncio.gather(*tasks)
        rows = []
        for i, (p, r) in enumerate(zip(ps, out)):
            g = next((s[1] for s in r["spans"] if s[0] == f"{case}-new"), len(r["tokens"]))
            first = next((ts - resumed for ts, _ in stamps.get(f"{name}-{i}", []) if ts > resumed), None)
            rows.append(dict(tokens_at_pause=at_pause.get(f"{name}-{i}"), tokens=len(r["tokens"]), finish=r["finish"],
                             spans=r["spans"], resume_to_first_new_token_s=first, **self.deltas(p, r, g, old, new)))
        return dict(scenario=name, pause_call_s=round(pause_s, 4), reset_prefix_cache=reset, requests=rows)

    async def prefix_reuse(self, case: int, reset_between: bool) -> dict:
        """A finished request leaves its prompt's full blocks cached; new weights load while idle; the
        same prompt again: cache hit or not, and whose KV its tokens attend to."""
        rng = random.Random(case)
        prompt = [1] + [rng.randrange(5, 95) for _ in range(PROMPT_LEN - 1)]
        await self.request(f"reuse-{case}-a", prompt, {}, {})
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        old, new = await self.load_other()
        reset = await self.engine.reset_prefix_cache() if reset_between else None
        await self.engine.resume_generation()
        r = await self.request(f"reuse-{case}-b", prompt, {}, {})
        k = r["cached"] or 1
        return dict(scenario="prefix_reuse" + ("+idle_reset" if reset_between else ""), reset_prefix_cache=reset,
                    num_cached_tokens=r["cached"], **self.deltas(prompt, r, 0, old, new, k=k))


async def main(out_dir: Path) -> None:
    dirs = {n: str(make_tiny_model(out_dir / n, arch="llama", seed=s, force=True)) for n, s in (("A", 0), ("B", 1))}
    cfg = RolloutConfig(model=dirs["A"], dtype="float32", max_model_len=256, weight_transfer="none",
                        engine_in_process=True, engine_options={"block_size": 32, "enable_prefix_caching": True})
    started = time.perf_counter()
    stream = StreamEngine.start(cfg)
    print(json.dumps({"engine_start_s": round(time.perf_counter() - started, 1)}), flush=True)
    probe = Probe(stream, dirs)
    try:
        for case, name in enumerate(SCENARIOS, start=1):
            print(json.dumps(await probe.scenario(name, case)), flush=True)
        for case, reset in ((20, False), (21, True)):
            print(json.dumps(await probe.prefix_reuse(case, reset)), flush=True)
    finally:
        stream.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where the two tiny models are written (a temp dir)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    asyncio.run(main(args.out or Path(tempfile.mkdtemp(prefix="kv_refit_probe."))))
