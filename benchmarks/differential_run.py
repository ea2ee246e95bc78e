"""Differential check of a refactor: two run directories of the same config and seed must agree
bit for bit -- `learn/loss` and `learn/grad_norm` at every step, and every weight of every
checkpoint they both hold.

    # a run before the change (a checkout of the old commit) and one after, same command line:
    megatron-rl train --config configs/tiny_cpu_scratch.yaml run.dir=A run.steps=20 run.eval_every=0 \\
        run.checkpoint_every=10
    python -m benchmarks.differential_run A B          # prints the table; exit 1 on any difference

`--record FILE` writes run A's figures (per-step loss and grad norm, a sha256 of each checkpoint's
weights) as JSON, the form tests/e2e/test_train.py compares a fresh run against.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

KEYS = ("learn/loss", "learn/grad_norm")


def step_rows(run_dir: Path) -> dict[int, dict[str, float]]:
    rows = {}
    for line in (run_dir / "metrics" / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if "learn/loss" in r:
            rows[int(r["step"])] = {k: r[k] for k in KEYS}
    return rows


def weights_digest(ckpt_dir: Path) -> str:
    """sha256 of a committed checkpoint's model and optimizer tensors (the one digest `megatron-rl replay` uses)."""
    from megatron_rl.replay import weights_digest as digest_of_weights_dir

    return digest_of_weights_dir(ckpt_dir / "weights")


def machine() -> dict:
    """What bit-identity across machines depends on: the torch build and the CPU kernels it picks, which
    follow the instruction set and the vendor (an AMD and an Intel AVX512 machine differ in the last bits
    of run A's loss)."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_vendor": cpu_vendor()}


def cpu_vendor() -> str:
    """The CPU's vendor id ("GenuineIntel", "AuthenticAMD", ...), "" where /proc/cpuinfo does not say."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def recording_for(recorded: list[dict], here: dict) -> dict | None:
    """The recording made on a machine like `here`: one with every key equal, else one recorded before
    the vendor was part of a machine's description whose other keys are equal; None when there is none."""
    exact = [r for r in recorded if r["machine"] == here]
    legacy = [r for r in recorded if "cpu_vendor" not in r["machine"]
              and r["machine"] == {k: v for k, v in here.items() if k != "cpu_vendor"}]
    return (exact or legacy or [None])[0]


def figures(run_dir: Path) -> dict:
    ckpts = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "weights").is_dir())
    return {"machine": machine(), "steps": {str(s): v for s, v in sorted(step_rows(run_dir).items())},
            "weights_sha256": {p.name: weights_digest(p) for p in ckpts}}


def compare(a: dict, b: dict) -> list[str]:
    """Every difference between two figures() dicts, in words ([] when bit-identical)."""
    problems = []
    if a["steps"].keys() != b["steps"].keys():
        problems.append(f"steps differ: {sorted(a['steps'], key=int)} vs {sorted(b['steps'], key=int)}")
    for s in sorted(a["steps"].keys() & b["steps"].keys(), key=int):
        for k in KEYS:
            if a["steps"][s][k] != b["steps"][s][k]:
                problems.append(f"step {s} {k}: {a['steps'][s][k]!r} vs {b['steps'][s][k]!r}")
    shared = a["weights_sha256"].keys() & b["weights_sha256"].keys()
    if not shared:
        problems.append("no checkpoint in common")
    for name in sorted(shared):
        if a["weights_sha256"][name] != b["weights_sha256"][name]:
            problems.append(f"{name}: weights differ")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path, nargs="?")
    ap.add_argument("--record", type=Path, help="write run A's figures as JSON")
    args = ap.parse_args(argv)
    fa = figures(args.a)
    if args.record:
        args.record.write_text(json.dumps(fa, indent=1) + "\n")
    if args.b is None:
        return 0
    fb = figures(args.b)
    print(f"{'step':>5} {'loss A':>22} {'loss B':>22} {'grad_norm A':>22} {'grad_norm B':>22}")
    for s in sorted(fa["steps"], key=int):
        ra, rb = fa["steps"][s], fb["steps"].get(s, {})
        print(f"{s:>5} {ra['learn/loss']!r:>22} {rb.get('learn/loss')!r:>22} "
              f"{ra['learn/grad_norm']!r:>22} {rb.get('learn/grad_norm')!r:>22}")
    for name in sorted(fa["weights_sha256"]):
        print(f"{name}: {fa['weights_sha256'][name][:16]} vs {fb['weights_sha256'].get(name, '-')[:16]}")
    problems = compare(fa, fb)
    print("bit-identical" if not problems else "DIFFERENT:\n  " + "\n  ".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
