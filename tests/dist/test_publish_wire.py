"""Gloo publication protocol between real processes: intact, corrupted, aborted.

    python -m pytest tests/dist/test_publish_wire.py -q

Rank 0 publishes; ranks 1..2 receive and report what they got through a queue.
"""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rl.platform.listen import listening_store
from megatron_rl.publish.wire import StagingBuffers, open_group, receive_publication, send_publication

pytestmark = pytest.mark.dist

WORLD = 3


def _weights(version):
    g = torch.Generator().manual_seed(version)
    return [[(f"model.layers.{i}.w", torch.randn(64, 32, generator=g)),
             (f"model.layers.{i}.b", torch.randn(32, generator=g).to(torch.bfloat16)),
             (f"model.layers.{i}.t", torch.randn(8, 16, generator=g).t()),  # not contiguous
             (f"model.layers.{i}.e", torch.empty(0, 4))] for i in range(4)]


def _corrupt_bucket_2(spec, buf):
    if spec.index == 2:
        buf[5] ^= 0x40


def _failing_source():
    yield from _weights(1)[0]
    raise RuntimeError("gather failed on stage 1")


def _run(rank, port, queue, read):
    # every rank joins the store the test opened (a port bound at once: no other process can take it first)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    pg = open_group("127.0.0.1", port, rank, WORLD, timeout_s=60, store=store)
    if rank == 0:
        send_publication(pg, 1, _weights(1), bucket_bytes=9000)
        send_publication(pg, 2, _weights(2), bucket_bytes=9000, fault_hook=_corrupt_bucket_2)
        try:
            send_publication(pg, 3, _failing_source(), bucket_bytes=9000)
        except RuntimeError as err:
            queue.put((0, str(err)))
        read.wait(120)
        return
    staging = StagingBuffers()  # reused across the three publications, as a rollout engine does
    for _ in range(3):
        got = receive_publication(pg, staging)
        queue.put((rank, got.ok, got.error, got.bad_bucket,
                   None if got.manifest is None else got.manifest.version,
                   [(n, t.clone()) for n, t in got.tensors]))
    # Tensors in a queue go by shared memory that this process hands out: it stays until the test has them.
    read.wait(120)


def test_publication_intact_corrupted_and_aborted():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    server = listening_store("127.0.0.1", WORLD, timeout_s=120)
    read = ctx.Event()
    procs = [ctx.Process(target=_run, args=(r, server.port, queue, read)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in range(1 + 3 * (WORLD - 1))]
    read.set()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    trainer = [r for r in results if r[0] == 0]
    assert trainer == [(0, "gather failed on stage 1")]
    expected = [pair for group in _weights(1) for pair in group]
    for rank in (1, 2):
        mine = [r for r in results if r[0] == rank]
        (_, ok1, err1, _, v1, t1), (_, ok2, err2, bad2, v2, t2), (_, ok3, err3, _, _, t3) = mine
        assert ok1 and err1 is None and v1 == 1
        assert [n for n, _ in t1] == [n for n, _ in expected]
        assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(t1, expected))
        assert not ok2 and bad2 == 2 and v2 == 2 and "bucket 2" in err2 and "blocksum mismatch" in err2 and t2 == []
        assert not ok3 and "gather failed on stage 1" in err3 and t3 == []
