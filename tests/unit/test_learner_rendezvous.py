"""The learner's torch.distributed rendezvous port cannot be taken between choosing and binding it.

    python -m pytest tests/unit/test_learner_rendezvous.py -q

Rank 0 used to probe a free port (platform.spawn.free_port), tell every rank, and bind it only
inside init_process_group: on a busy machine another process could take it in between
(EADDRINUSE).  Now rank 0's TCPStore listens first (port 0: the OS picks and binds at once) and
the ranks are told the bound port (ranks/build.py Rendezvous.address / join).
The race is injected by making the free-port probe return a port another socket holds; two real
ranks (this process and a spawned one) then join over gloo and all-reduce.
"""

import multiprocessing as mp
import socket

import pytest
import torch
import torch.distributed as dist

from megatron_rl.platform import spawn
from megatron_rl.ranks.build import Rendezvous as Rank

pytestmark = pytest.mark.unit


def _platform():
    from megatron_rl.platform import detect_platform

    return detect_platform(dtype="fp32", device="cpu")


def _rank1(addr: str, port: int, out) -> None:
    try:
        Rank(1, 2).join(addr, port, _platform())
        t = torch.tensor([10.0])
        dist.all_reduce(t)
        out.put(float(t))
        dist.destroy_process_group()
    except Exception as err:  # reported to the test
        out.put(repr(err))


def test_a_port_taken_after_the_probe_does_not_break_the_rendezvous(monkeypatch):
    squatter = socket.socket()
    squatter.bind(("0.0.0.0", 0))
    squatter.listen()
    monkeypatch.setattr(spawn, "free_port", lambda host="127.0.0.1": squatter.getsockname()[1])
    rank0 = Rank(0, 2)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = None
    try:
        addr, port = rank0.address()
        assert port != squatter.getsockname()[1]
        proc = ctx.Process(target=_rank1, args=(addr, port, out))
        proc.start()
        rank0.join(addr, port, _platform())
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        assert float(t) == 11.0 and out.get(timeout=120) == 11.0  # both ranks reduced over the one group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if proc is not None:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
        squatter.close()


def _reduce(rank: int, world_size: int) -> tuple:
    import os

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t), int(os.environ["MASTER_PORT"])


def test_run_distributed_opens_its_rendezvous_where_no_process_can_take_it_first(monkeypatch):
    # The same race in the spawn helper the tests and conversion tools use: its parent used to probe a port
    # and rank 0 bound it later (a CI run on two workers lost a dist test to EADDRINUSE so).
    squatter = socket.socket()
    squatter.bind(("0.0.0.0", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    monkeypatch.setattr(spawn, "free_port", lambda host="127.0.0.1": taken)
    try:
        got = spawn.run_distributed(_reduce, 2, timeout=120)
    finally:
        squatter.close()
    assert [total for total, _ in got] == [3.0, 3.0]  # both ranks reduced over one group
    ports = {port for _, port in got}
    assert len(ports) == 1 and ports != {taken}  # one rendezvous, not on the port the probe named


def test_rank_0_refuses_to_join_without_its_store():
    with pytest.raises(RuntimeError, match=r"before Rendezvous.address\(\)"):
        Rank(0, 2).join("127.0.0.1", 1, _platform())
