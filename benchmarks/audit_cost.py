"""What the in-training audit costs a streaming run (issue 46 item 6), its arms side by side in one invocation.

    flock /tmp/mrl-heavy.lock .venv/bin/python -m benchmarks.audit_cost [--steps 40] [--tokens 200]

Three streaming runs of benchmarks/stream_training.py's fixed-length workload (async, 4 prompts x 4 samples,
--tokens tokens per response with EOS ignored: most samples span versions, so every audit has sequences to
re-score), the same seed, differing only in `audit.every`: 0 (off: no weight ring either), the default a
streaming run now gets (audit/config.py DEFAULT_EVERY), and 1 (every step: the worst case).  Printed per arm:
the mean step seconds inside the clock and its phases (`audit` is the auditor's own seconds, averaged over
every step; the ring's copy of the weights is inside `publish`), the steps audited and the segments judged.
Then the cost of the default as a share of the off arm's step: the audit's measured seconds per step
(`audit_share`) and, as a cross-check that carries the machine's noise, the difference in step seconds
(`step_share`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.stream_training import run
from megatron_rl.audit.config import DEFAULT_EVERY


def audited(root: Path, name: str) -> dict:
    """The arm's audits, read from its metrics: steps audited and segments judged."""
    rows = [json.loads(line) for line in (root / name / "metrics" / "metrics.jsonl").read_text().splitlines()]
    audits = [r for r in rows if "system/time_audit_s" in r]
    return {"audited_steps": len(audits), "segments": int(sum(r.get("numerics/audit_segments", 0) for r in audits)),
            "worst_abs_delta": max((r.get("numerics/audit_worst_abs_delta", 0.0) for r in audits), default=None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per arm")
    args = ap.parse_args()
    args.longtail, args.stop_tokens, args.set, args.pin = False, 0, [], None  # stream_training.run's other knobs
    arms = {"off": 0, "default": DEFAULT_EVERY, "every_step": 1}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, every in arms.items():
            out = run(True, args, root, name=name, extra=(f"audit.every={every}",))
            if "failed" not in out:
                out.update(audited(root, name))
            results[name] = out
            print(json.dumps({"audit.every": every, **out}))
    if any("failed" in r for r in results.values()):
        raise SystemExit("no share: an arm failed (above)")
    off, default = results["off"]["per_step_s"], results["default"]["per_step_s"]
    print(json.dumps({"audit_share": round(default.get("time_audit", 0.0) / off["time_step"], 4),
                      "step_share": round(default["time_step"] / off["time_step"] - 1, 4),
                      "every_step_audit_share": round(results["every_step"]["per_step_s"].get("time_audit", 0.0)
                                                      / off["time_step"], 4)}))


if __name__ == "__main__":
    main()
