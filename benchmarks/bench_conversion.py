"""Benchmark HF <-> Megatron conversion against plain safetensors I/O of the same bytes.

    python benchmarks/bench_conversion.py [--arch llama] [--size medium] [--repeats 3] [--workdir DIR] [--keep]
    python benchmarks/bench_conversion.py --arch qwen3_moe --size medium_half   # ~302M, 8 experts x 12 layers x 3

Makes a random model of `--arch` and `--size` (llama medium: ~283M params; qwen3_moe medium: ~604M,
medium_half: ~302M), then, each in a fresh process so the
numbers include interpreter start and imports alike, `--repeats` rounds of:
  baseline     read every tensor with safetensors and write them all back (same bytes)
  hf-to-mcore  `megatron-rl convert hf-to-mcore` at TP1 PP1
  mcore-to-hf  `megatron-rl convert mcore-to-hf`
and prints the median wall time / median baseline wall time (goal <= 2) and the converting
process's peak RSS divided by the model's size in bytes.  The baseline's peak RSS ratio is
printed too, for what a reader that holds the whole model costs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE = """
import sys
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
save_file(load_file(src), dst, metadata={"format": "pt"})
"""


# Runs argv[1:] and prints the peak RSS (KiB) of that command and what it waited for.
MEASURE = """
import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:]).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
sys.exit(rc)
"""


def timed(cmd: list[str]) -> tuple[float, float]:
    """Run `cmd` in a fresh child; return (wall seconds, its peak RSS in bytes)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", MEASURE, *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return wall, int(proc.stderr.strip().splitlines()[-1]) * 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", help="make-tiny-model architecture (default llama)")
    parser.add_argument("--size", default="medium", help="make-tiny-model size preset (default medium, ~283M)")
    parser.add_argument("--workdir", default=None, help="where to write the models (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the written models")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the three commands (medians are reported)")
    args = parser.parse_args()

    from megatron_rl.models.tiny import make_tiny_model

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_conversion_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        hf = make_tiny_model(work / "hf", arch=args.arch, size=args.size, seed=0, force=True)
        model_bytes = (hf / "model.safetensors").stat().st_size
        py = sys.executable
        (work / "baseline.py").write_text(BASELINE)
        commands = {
            "baseline": [py, str(work / "baseline.py"), str(hf / "model.safetensors"), str(work / "copy.safetensors")],
            "hf_to_mcore": [py, "-m", "megatron_rl.cli", "--log-level", "WARNING", "convert", "hf-to-mcore",
                            "--hf", str(hf), "--out", str(work / "mc"), "--force"],
            "mcore_to_hf": [py, "-m", "megatron_rl.cli", "--log-level", "WARNING", "convert", "mcore-to-hf",
                            "--mcore", str(work / "mc"), "--out", str(work / "back"), "--force"],
        }
        runs = {name: [] for name in commands}
        for _ in range(args.repeats):  # interleaved, so drift in machine speed hits all three alike
            for name, cmd in commands.items():
                runs[name].append(timed(cmd))
        (t_base, rss_base), (t_h2m, rss_h2m), (t_m2h, rss_m2h) = (
            (statistics.median(t for t, _ in r), max(m for _, m in r)) for r in runs.values())
        result = {
            "arch": args.arch,
            "model_params_M": round(model_bytes / 4 / 1e6, 1),
            "model_bytes_GB": round(model_bytes / 1e9, 3),
            "repeats": args.repeats,
            "baseline_s": round(t_base, 2),
            "hf_to_mcore_s": round(t_h2m, 2),
            "mcore_to_hf_s": round(t_m2h, 2),
            "hf_to_mcore_time_ratio": round(t_h2m / t_base, 2),
            "mcore_to_hf_time_ratio": round(t_m2h / t_base, 2),
            "baseline_peak_rss_ratio": round(rss_base / model_bytes, 2),
            "hf_to_mcore_peak_rss_ratio": round(rss_h2m / model_bytes, 2),
            "mcore_to_hf_peak_rss_ratio": round(rss_m2h / model_bytes, 2),
        }
        print(json.dumps(result))
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
