"""Publication time vs one raw gloo broadcast of the same bytes, measured side by side.

    python benchmarks/bench_publish.py --params-m 300 --receivers 1 [--checksums blocksum,blake3]

Rank 0 publishes tensors shaped like the "medium" tiny-model preset (per-layer groups,
checksummed buckets, zero-copy sends, verification pipelined with receiving, staging
buffers reused as a rollout engine reuses them) to `receivers` processes, then broadcasts
the same number of bytes as one flat buffer into a buffer allocated once.  Each
publication is followed at once by its raw broadcast and the ratio of the pair is taken,
so the machine's drift (a shared VM's speed changes over seconds) cancels; the first round
warms up and each reported ratio is the median over the rest.  One line per checksum
algorithm: publish / raw (goal <= 1.5 with the default algorithm), so the cost of each
digest is visible; and the same bytes as one bare broadcast per tensor, the floor of
sending tensors where they lie.
"""

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

from megatron_rl.platform.spawn import free_port
from megatron_rl.publish.checksum import CHECKSUMS, DEFAULT_CHECKSUM
from megatron_rl.publish.wire import StagingBuffers, _bcast, _ibcast, _wait, open_group, receive_publication, send_publication


def make_groups(params_m: float, hidden: int = 1024, ffn: int = 2816, kv: int = 512):
    per_layer = [("q", (hidden, hidden)), ("k", (kv, hidden)), ("v", (kv, hidden)), ("o", (hidden, hidden)),
                 ("gate", (ffn, hidden)), ("up", (ffn, hidden)), ("down", (hidden, ffn))]
    n_layer = sum(a * b for _, (a, b) in per_layer)
    layers = max(1, int(params_m * 1e6 // n_layer))
    g = torch.Generator().manual_seed(0)
    return [[(f"model.layers.{i}.{n}.weight", torch.randn(s, generator=g)) for n, s in per_layer] for i in range(layers)]


def run(rank, world, port, params_m, bucket_mb, algos, rounds, out):
    pg = open_group("127.0.0.1", port, rank, world)
    groups = make_groups(params_m) if rank == 0 else None
    nbytes = torch.tensor([0], dtype=torch.int64)
    if rank == 0:
        nbytes[0] = sum(t.numel() * 4 for grp in groups for _, t in grp)
    _bcast(pg, nbytes)
    flat = torch.ones(int(nbytes[0]), dtype=torch.uint8)
    # The same bytes as one broadcast per tensor (no protocol, no checksum): the floor of any
    # zero-copy design over gloo.
    sizes = [t.numel() * 4 for grp in make_groups(params_m) for _, t in grp] if rank else None
    parts = [t.view(-1).view(torch.uint8) for grp in groups for _, t in grp] if rank == 0 else \
        list(torch.split(torch.ones(sum(sizes), dtype=torch.uint8), sizes))
    per_tensor = []
    staging = StagingBuffers()  # a rollout engine keeps its staging buffers between publications
    def timed(fn) -> float:
        pg.barrier().wait()
        t0 = time.perf_counter()
        fn()
        pg.barrier().wait()
        return time.perf_counter() - t0

    def publish(algo):
        if rank == 0:
            send_publication(pg, 1, groups, bucket_bytes=bucket_mb << 20, checksum_algo=algo)
        else:
            assert receive_publication(pg, staging).ok

    ratios = {algo: [] for algo in algos}
    raw = []
    for r in range(rounds + 1):  # round 0 warms sockets and buffers
        for algo in algos:
            t_pub = timed(lambda: publish(algo))
            t_raw = timed(lambda: _bcast(pg, flat))
            if r:
                ratios[algo].append(t_pub / t_raw)
                raw.append(t_raw)
        t_parts = timed(lambda: _wait(_ibcast(pg, parts)))
        t_raw = timed(lambda: _bcast(pg, flat))
        if r:
            per_tensor.append(t_parts / t_raw)
            raw.append(t_raw)
    if rank == 0:
        out.put((int(nbytes[0]), {a: statistics.median(x) for a, x in ratios.items()}, statistics.median(raw),
                 len(parts), statistics.median(per_tensor)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params-m", type=float, default=300.0, help="model size in millions of fp32 params")
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--checksums", default=",".join(CHECKSUMS), help=f"comma-separated, from {CHECKSUMS}")
    ap.add_argument("--rounds", type=int, default=7, help="measured rounds (after one warm-up)")
    args = ap.parse_args()
    algos = args.checksums.split(",")
    unknown = [a for a in algos if a not in CHECKSUMS]
    if unknown:
        ap.error(f"unknown checksum {unknown[0]!r}; choose from {CHECKSUMS}")
    ctx = mp.get_context("spawn")
    out, port, world = ctx.Queue(), free_port(), 1 + args.receivers
    procs = [ctx.Process(target=run, args=(r, world, port, args.params_m, args.bucket_mb, algos, args.rounds, out))
             for r in range(world)]
    for p in procs:
        p.start()
    nbytes, pub_ratio, t_raw, n_parts, parts_ratio = out.get()
    for p in procs:
        p.join()
    print(f"bytes={nbytes / 1e9:.2f} GB receivers={args.receivers} bucket={args.bucket_mb} MiB "
          f"raw_broadcast={t_raw:.2f}s (median)")
    print(f"no protocol, one broadcast per tensor ({n_parts}): ratio={parts_ratio:.2f}")
    for algo, ratio in pub_ratio.items():
        goal = " (goal <= 1.5)" if algo == DEFAULT_CHECKSUM else ""
        print(f"checksum={algo:<8} publish ~{ratio * t_raw:.2f}s ratio={ratio:.2f}{goal}")


if __name__ == "__main__":
    main()
