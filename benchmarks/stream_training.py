"""Streaming rollouts vs round-based rollouts in whole training runs, side by side (issue 27).

    flock /tmp/mrl-heavy.lock .venv/bin/python benchmarks/stream_training.py [--steps 10] [--stop-tokens 13]

Both arms train the tiny recipe (configs/tiny_cpu_scratch.yaml) in async mode for the same steps with
the same seed.  Lengths: by default every response is exactly --tokens tokens (EOS ignored), so both
arms generate the same number of tokens and no round waits for a straggler; with --stop-tokens K, K
token ids end a response (about K/128 per token for the random tiny model), so lengths are long-tailed
up to --tokens (each arm then reports its own token count).  The arms differ only in rollout.streaming (and with it the rollout actor: one offline generate
call per round, or vLLM's async engine with prompt groups streaming into batches and publications
landing in flight, rollout.inflight_refit recompute).  Start-up is excluded: the clock runs from the
first learner step's metrics to the last one's.  Printed: one JSON line per arm (loop seconds, steps,
generated tokens, generated tokens per second of loop, mean taken Δv, share of samples spanning
versions) and the ratio stream / rounds of tokens per second.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(streaming: bool, args, root: Path) -> dict:
    run_dir = root / ("stream" if streaming else "rounds")
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(REPO / "configs" / "tiny_cpu_scratch.yaml"),
           f"run.dir={run_dir}", "run.mode=async", f"run.steps={args.steps}", "run.prompts_per_step=4",
           "run.group_size=4", "learner.micro_batch_size=16", "run.eval_every=0", "run.checkpoint_every=0",
           "data.eval_size=8", f"rollout.max_tokens={args.tokens}", f"rollout.max_model_len={args.tokens + 56}",
           f"rollout.streaming={'true' if streaming else 'false'}"]
    if args.stop_tokens:
        cmd += ["rollout.ignore_eos=false", f"rollout.stop_token_ids=[{','.join(str(40 + i) for i in range(args.stop_tokens))}]"]
    else:
        cmd += ["rollout.ignore_eos=true"]
    with open(root / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed (exit {proc.returncode}); see {root / (run_dir.name + '.log')}")
    rows = [json.loads(line) for line in (run_dir / "metrics" / "metrics.jsonl").read_text().splitlines()]
    learn = [r for r in rows if "learn/loss" in r]
    loop_s = learn[-1]["time"] - learn[0]["time"]
    tokens = sum(r["system/generated_tokens"] for r in learn[1:])  # generated for the steps inside the clock
    return {"arm": run_dir.name, "loop_s": round(loop_s, 2), "steps": len(learn), "generated_tokens": tokens,
            "tok_s": round(tokens / loop_s, 1),
            "taken_dv_mean": round(sum(r["queue/taken_dv/p50"] for r in learn) / len(learn), 2),
            "multi_version_fraction": round(sum(r.get("system/stream_multi_version_fraction", 0.0) for r in learn)
                                            / len(learn), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=200, help="response length (EOS ignored)")
    ap.add_argument("--stop-tokens", type=int, default=0, help="token ids that end a response (0: fixed lengths)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per arm")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rounds, stream = run(False, args, Path(tmp)), run(True, args, Path(tmp))
    print(json.dumps(rounds))
    print(json.dumps(stream))
    print(json.dumps({"ratio_tok_s": round(stream["tok_s"] / rounds["tok_s"], 3),
                      "ratio_loop_s": round(rounds["loop_s"] / stream["loop_s"], 3)}))


if __name__ == "__main__":
    main()
