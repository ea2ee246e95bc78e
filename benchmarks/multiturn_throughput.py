"""Multi-turn episodes with a slow tool vs single-turn generation, one streaming engine (issue 28, benchmark).

    flock /tmp/mrl-heavy.lock timeout 900 python benchmarks/multiturn_throughput.py   # a tiny random llama
    python benchmarks/multiturn_throughput.py --model DIR --episodes 256 --turns 4 --turn-tokens 16 --tool-ms 50
    python benchmarks/multiturn_throughput.py --stop-tokens 6 --turn-tokens 32   # turns of varying length

One StreamEngine (vLLM's AsyncLLM; engine core and its worker in processes of their own, max_num_seqs
--capacity, prefix caching on, KV blocks of --block-size) serves both arms one after the other, after an
untimed warm-up (multi first); both generate the same tokens (temperature 1, seeded):
- single: --episodes requests, all submitted at once, request i generating (ignore_eos) as many tokens as
  episode i did: --turns x --turn-tokens each without --stop-tokens.
- multi: --episodes episodes at once, played by rollout/episodes.py's EpisodePlayer (as the rollout actor
  plays them) with the `sleep_tool` environment registered here: --turns assistant turns of --turn-tokens
  tokens, each but the last followed by a tool call that sleeps --tool-ms ms off the event loop and answers
  a short observation.  Every turn is one engine request with the whole episode so far as its prompt.
With --stop-tokens K, turns end as a policy's do, at a sampled stop token: K token ids of the tiny
tokenizer's letters stop a turn (about K/128 of each sample's probability under the random model), so turn
lengths vary (geometric, capped at --turn-tokens) and episodes fall out of step; the single arm then
generates each episode's own total in one request (ignore_eos), so the arms still generate equal tokens.
Without it every turn has exactly --turn-tokens tokens and all episodes meet their tools at once (lockstep).
Occupancy (engine_occupancy.py): time-weighted running requests / --capacity over the arm, and for multi
over the time at least one tool call sleeps.  Prints one JSON line per arm (with prompt tokens prefilled
and taken from the prefix cache) for each of --repeats pairs, run in turn on the one engine, and one line
with ratio = median multi tok/s / median single tok/s (goal >= 0.7: tool latency overlapped, not
serialised): one pair of 2-3 s arms moved the ratio by 0.3 between invocations on a shared 2-core VM.  Ends with os._exit: no finalizer of vLLM's zmq context runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from engine_occupancy import Occupancy, union  # benchmarks/engine_occupancy.py (run this file as a script)

from megatron_rl.envs.protocol import Environment, StepResult

TOOL_CALLS: list[tuple[float, float]] = []
STOP_IDS = list(range(81, 97))  # the tiny tokenizer's letters k..z: --stop-tokens K of them end a turn  # (start, end) of every tool call; list.append is atomic


@dataclasses.dataclass(kw_only=True)
class SleepToolConfig:
    """The benchmark's environment: a fixed number of turns, a tool call after each but the last."""

    turns: int = 4
    """Assistant turns per episode; the last one ends the episode."""
    tool_ms: float = 50.0
    """Milliseconds every tool call sleeps (in the environment's step, off the engine's event loop)."""

    def __post_init__(self) -> None:
        if self.turns < 1:
            raise ValueError(f"turns must be >= 1, got {self.turns}")
        if self.tool_ms < 0:
            raise ValueError(f"tool_ms must be >= 0, got {self.tool_ms}")


class SleepTool(Environment):
    """After each assistant turn but the last, a tool call: sleeps, then answers `result <turn>`."""

    name = "sleep_tool"

    def __init__(self, config: SleepToolConfig):
        self.config, self.turn = config, 0

    def reset(self, example) -> str:
        self.turn = 0
        return example

    def step(self, action: str) -> StepResult:
        self.turn += 1
        if self.turn >= self.config.turns:
            return StepResult("", reward=1.0, done=True)
        started = time.perf_counter()
        time.sleep(self.config.tool_ms / 1000)
        TOOL_CALLS.append((started, time.perf_counter()))
        return StepResult(f"result {self.turn}", info={"tool_calls": 1})


class Turns:
    """The engine as the player sees it, keeping (prompt tokens, of them from the prefix cache) per turn."""

    def __init__(self, stream):
        self.stream, self.seen = stream, []

    async def generate(self, request_id: str, prompt: list[int], sampling: dict):
        result = await self.stream.generate(request_id, prompt, sampling)
        self.seen.append((len(prompt), result.num_cached_tokens))
        return result


def texts(rng: random.Random, n: int) -> list[str]:
    return [" ".join("".join(rng.choices("abcdefghij", k=4)) for _ in range(5)) for _ in range(n)]


async def single_arm(args, stream, prompts: list[list[int]], occupancy: Occupancy, lengths: list[int]) -> dict:
    sampling = {"temperature": 1.0, "ignore_eos": True}
    start = time.perf_counter()
    results = await asyncio.gather(*(stream.generate(f"single-{i}", p, {**sampling, "seed": args.seed + i,
                                                                        "max_tokens": n})
                                     for i, (p, n) in enumerate(zip(prompts, lengths))))
    end = time.perf_counter()
    tokens = sum(len(r.response_tokens) for r in results)
    return {"arm": "single", "wall_s": end - start, "tokens": tokens, "tok_s": tokens / (end - start),
            "occupancy": occupancy.mean(start, end, args.capacity),
            "prefill_tokens": sum(len(p) - r.num_cached_tokens for p, r in zip(prompts, results)),
            "cached_tokens": sum(r.num_cached_tokens for r in results)}


async def multi_arm(args, stream, player, examples: list[str], occupancy: Occupancy, tag: str) -> dict:
    params = {"temperature": 1.0, "ignore_eos": not args.stop_tokens, "seed": args.seed,
              "stop_token_ids": STOP_IDS[:args.stop_tokens]}
    TOOL_CALLS.clear()
    start = time.perf_counter()
    turns = Turns(stream)
    samples = await player.group(turns, tag, examples, params, 1, None, lambda result: {})
    end = time.perf_counter()
    reasons = {s.episode.terminal_reason for s in samples}
    assert reasons == {"done"}, f"episodes ended with {reasons}, not all done: raise --max-model-len"
    lengths = [sum(s.action_mask) for s in samples]
    tokens = sum(lengths)
    busy = union(TOOL_CALLS)
    events = sorted([(t0, 1) for t0, _ in TOOL_CALLS] + [(t1, -1) for _, t1 in TOOL_CALLS])
    return {"arm": "multi", "wall_s": end - start, "tokens": tokens, "tok_s": tokens / (end - start),
            "occupancy": occupancy.mean(start, end, args.capacity),
            "occupancy_while_tools": occupancy.mean_over(TOOL_CALLS, args.capacity),
            "tool_calls": len(TOOL_CALLS), "tool_time_share": sum(b - a for a, b in busy) / (end - start),
            "max_concurrent_tools": max(itertools.accumulate(d for _, d in events), default=0),
            "prefill_tokens": sum(n - c for n, c in turns.seen), "cached_tokens": sum(c for _, c in turns.seen),
            "episode_tokens": sum(len(s.prompt_tokens) + len(s.response_tokens) for s in samples) / len(samples),
            "turn_tokens_mean": tokens / sum(s.episode.turns for s in samples), "lengths": lengths}


async def run(args, model_dir: str) -> list[dict]:
    from megatron_rl.envs.config import EnvConfig
    from megatron_rl.envs.registry import register_environment
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.episodes import EpisodePlayer
    from megatron_rl.rollout.stream_engine import StreamEngine

    register_environment(SleepTool, SleepToolConfig)
    env = EnvConfig(name="sleep_tool", options={"turns": args.turns, "tool_ms": args.tool_ms}, max_turns=args.turns,
                    max_total_tokens=args.max_model_len, chat_template="plain", system_prompt="")
    player = EpisodePlayer(env, model_dir, max_tokens_per_turn=args.turn_tokens)
    options = {"distributed_executor_backend": "uni", "max_num_seqs": args.capacity, "enable_prefix_caching": True,
               "block_size": args.block_size, "disable_log_stats": False}
    cfg = RolloutConfig(model=model_dir, dtype="float32", max_model_len=args.max_model_len, weight_transfer="none",
                        engine_in_process=False, engine_options=options)
    stream = StreamEngine.start(cfg)
    occupancy = Occupancy(stream.engine)
    rng = random.Random(args.seed)
    await multi_arm(args, stream, player, texts(rng, args.capacity), occupancy, "warm")  # untimed: allocate, compile
    pairs = []
    for _ in range(args.repeats):  # fresh texts each time: no prompt of an earlier pair is in the prefix cache
        episodes, singles = texts(rng, args.episodes), texts(rng, args.episodes)
        # multi first: the single arm generates, request by request, what each episode generated
        multi = await multi_arm(args, stream, player, episodes, occupancy, "multi")
        single = await single_arm(args, stream, [player.chat.prompt_tokens(x) for x in singles], occupancy,
                                  multi.pop("lengths"))
        pairs.append((single, multi))
    stream.shutdown()
    return pairs


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint directory (default: a tiny random llama, seed 0)")
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"], help="the random llama's size")
    ap.add_argument("--episodes", type=int, default=256, help="concurrent episodes (and single-turn requests)")
    ap.add_argument("--turns", type=int, default=4, help="assistant turns per episode (tool calls: one fewer)")
    ap.add_argument("--turn-tokens", type=int, default=16, help="tokens per assistant turn")
    ap.add_argument("--tool-ms", type=float, default=50.0)
    ap.add_argument("--capacity", type=int, default=256, help="the engine's max_num_seqs")
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=32, help="KV block (vLLM's CPU default 128 caches no prefix "
                                                               "shorter than 128 tokens: every turn prefilled whole)")
    ap.add_argument("--stop-tokens", type=int, default=0, choices=range(0, len(STOP_IDS) + 1), metavar="K",
                    help="turns end at any of K stop tokens (variable lengths); 0: every turn --turn-tokens long")
    ap.add_argument("--repeats", type=int, default=3, help="pairs of arms (multi, then single) run in turn; the "
                                                               "ratio is of the arms' median tok/s")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main() -> None:
    args = parse()
    code = 1
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if not args.model:
                from megatron_rl.models.tiny import make_tiny_model

                args.model = str(make_tiny_model(Path(tmp) / "tiny", arch="llama", size=args.size, seed=0))
            pairs = asyncio.run(run(args, args.model))
        for single, multi in pairs:
            assert single["tokens"] == multi["tokens"], (single, multi)
            assert args.stop_tokens or multi["tokens"] == args.episodes * args.turns * args.turn_tokens, multi
            for arm in (single, multi):
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in arm.items()}), flush=True)
        single_tok_s = statistics.median(single["tok_s"] for single, _ in pairs)
        multi_tok_s = statistics.median(multi["tok_s"] for _, multi in pairs)
        print(json.dumps({"episodes": args.episodes, "turns": args.turns, "turn_tokens": args.turn_tokens,
                          "tool_ms": args.tool_ms, "capacity": args.capacity, "stop_tokens": args.stop_tokens,
                          "pair_ratios": [round(m["tok_s"] / s["tok_s"], 3) for s, m in pairs],
                          "single_tok_s": round(single_tok_s), "multi_tok_s": round(multi_tok_s),
                          "ratio": round(multi_tok_s / single_tok_s, 3)}), flush=True)
        code = 0
    except BaseException:  # noqa: BLE001 -- printed, then the hard exit below
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # vLLM's zmq context is never finalized (tests/e2e/stream_refit_scenarios.py says why)


if __name__ == "__main__":
    main()
