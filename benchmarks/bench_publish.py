"""Publication time vs one raw gloo broadcast of the same bytes, measured side by side.

    python benchmarks/bench_publish.py --params-m 300 --receivers 1

Rank 0 publishes tensors shaped like the "medium" tiny-model preset (per-layer groups,
checksummed buckets, pipelined pack/verify) to `receivers` processes, then broadcasts the
same number of bytes as one flat buffer.  Prints both times and their ratio (goal <= 1.5).
"""

import argparse
import time

import torch
import torch.multiprocessing as mp

from megatron_rl.platform.spawn import free_port
from megatron_rl.publish.wire import _bcast, open_group, receive_publication, send_publication


def make_groups(params_m: float, hidden: int = 1024, ffn: int = 2816, kv: int = 512):
    per_layer = [("q", (hidden, hidden)), ("k", (kv, hidden)), ("v", (kv, hidden)), ("o", (hidden, hidden)),
                 ("gate", (ffn, hidden)), ("up", (ffn, hidden)), ("down", (hidden, ffn))]
    n_layer = sum(a * b for _, (a, b) in per_layer)
    layers = max(1, int(params_m * 1e6 // n_layer))
    g = torch.Generator().manual_seed(0)
    return [[(f"model.layers.{i}.{n}.weight", torch.randn(s, generator=g)) for n, s in per_layer] for i in range(layers)]


def run(rank, world, port, params_m, bucket_mb, out):
    pg = open_group("127.0.0.1", port, rank, world)
    groups = make_groups(params_m) if rank == 0 else None
    nbytes = torch.tensor([0], dtype=torch.int64)
    if rank == 0:
        nbytes[0] = sum(t.numel() * 4 for grp in groups for _, t in grp)
    _bcast(pg, nbytes)
    flat = torch.ones(int(nbytes[0]), dtype=torch.uint8)
    for _ in range(2):  # second round is the measured one (first warms sockets/allocator)
        pg.barrier().wait()
        t0 = time.perf_counter()
        if rank == 0:
            send_publication(pg, 1, groups, bucket_bytes=bucket_mb << 20)
        else:
            assert receive_publication(pg).ok
        pg.barrier().wait()
        t_pub = time.perf_counter() - t0
        t0 = time.perf_counter()
        _bcast(pg, flat)
        pg.barrier().wait()
        t_raw = time.perf_counter() - t0
    if rank == 0:
        out.put((int(nbytes[0]), t_pub, t_raw))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params-m", type=float, default=300.0, help="model size in millions of fp32 params")
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--bucket-mb", type=int, default=64)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    out, port, world = ctx.Queue(), free_port(), 1 + args.receivers
    procs = [ctx.Process(target=run, args=(r, world, port, args.params_m, args.bucket_mb, out)) for r in range(world)]
    for p in procs:
        p.start()
    nbytes, t_pub, t_raw = out.get()
    for p in procs:
        p.join()
    print(f"bytes={nbytes / 1e9:.2f} GB receivers={args.receivers} bucket={args.bucket_mb} MiB")
    print(f"publish={t_pub:.2f}s raw_broadcast={t_raw:.2f}s ratio={t_pub / t_raw:.2f} (goal <= 1.5)")


if __name__ == "__main__":
    main()
