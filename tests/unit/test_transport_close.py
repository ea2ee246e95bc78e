"""Publication communicators are freed, not leaked (issue 31 item 7): a regroup (a second connect)
and a learner rank rebuilt for the next run destroy the communicator of the last group; on the
vLLM side, a second init_transfer_engine and shutdown do the same, for NCCL and for gloo.

    python -m pytest tests/unit/test_transport_close.py -q

The NCCL communicator is replaced by a double counting destroy() calls, the gloo group by one
counting shutdown() calls and whose last reference must go (no GPU, no Ray, no vLLM engine here);
the real LearnerWorker, transport and engine code paths run.
"""

from __future__ import annotations

import gc
import logging
import weakref
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.publish import trainer
from megatron_rl.publish import wire
from megatron_rl.publish.transports import GlooTransport, NcclTransport
from megatron_rl.ranks.rank import LearnerWorker
from megatron_rl.ranks.weights import PublishSettings

pytestmark = pytest.mark.unit


class Communicator:
    def __init__(self):
        self.destroyed = 0
        self.group = object()  # vLLM's StatelessProcessGroup, with its TCPStore

    def destroy(self):
        self.destroyed += 1


class GlooGroup:
    def __init__(self):
        self.shut_down = 0

    def shutdown(self):
        self.shut_down += 1


def _nccl_with(comm) -> NcclTransport:
    t = NcclTransport(bucket_bytes=1 << 20, checksum_algo="blocksum", timeout_s=1.0)
    t.group = comm
    return t


def test_a_second_connect_destroys_the_last_communicator(monkeypatch):
    monkeypatch.setattr(trainer, "engine_dtype", lambda workers: torch.float32)
    monkeypatch.setattr("ray.util.get_node_ip_address", lambda: "127.0.0.1")
    worker = LearnerWorker(rank=1, world_size=2)  # rank 1: no publisher, only its share
    old = Communicator()
    worker.transport = _nccl_with(old)
    worker.connect_rollout([], PublishSettings(transport="gloo"))
    assert old.destroyed == 1 and worker.transport.name == "gloo" and worker.publisher is None
    worker._leave_publication()
    assert old.destroyed == 1 and worker.transport is None  # closed once, not again


def test_a_rebuilt_rank_destroys_its_communicator():
    worker = LearnerWorker(rank=0, world_size=1)
    comm = Communicator()
    worker.transport = _nccl_with(comm)
    worker._drop_parts()
    assert comm.destroyed == 1 and worker.transport is None and worker.weights is None


def _gone(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is None


def _opener(made: list, make, released):
    """A stand-in for the call that forms a group (a new `make()`, kept in `made`), which first checks
    that every group made before is `released`: the last group goes before the next one forms."""
    def open_(*args, **kwargs):
        assert all(released(g) for g in made), "a new group formed while the last one was still held"
        made.append(make())
        return made[-1]
    return open_


def _gloo_released(group) -> bool:
    return group.shut_down == 1


def test_a_second_nccl_connect_destroys_the_last_communicator(monkeypatch):
    made: list = []
    monkeypatch.setattr("vllm.distributed.weight_transfer.nccl_common.trainer_init",
                        _opener(made, Communicator, lambda c: c.destroyed == 1))
    monkeypatch.setattr("ray.get", lambda refs, timeout=None: refs)
    t = NcclTransport(port=1, bucket_bytes=1 << 20, checksum_algo="blocksum", timeout_s=1.0)
    t.connect([], [], 1)
    t.connect([], [], 1)
    assert [c.destroyed for c in made] == [1, 0] and made[0].group is None
    t.close()
    assert [c.destroyed for c in made] == [1, 1] and t.group is None


def test_a_communicator_without_destroy_is_reported(caplog):
    from megatron_rl.publish.transports import destroy_communicator

    class Old:
        group = object()

    old = Old()
    with caplog.at_level(logging.WARNING):
        destroy_communicator(old)
    assert "has no destroy()" in caplog.text and old.group is None


def test_gloo_close_releases_the_group():
    t = GlooTransport(bucket_bytes=1 << 20, checksum_algo="blocksum", timeout_s=1.0)
    t.group, t.workers = GlooGroup(), ["engine"]
    group = weakref.ref(t.group)
    t.close()
    assert not t.connected and _gone(group)  # the transport held it last: its threads and sockets are gone


def test_a_second_gloo_connect_releases_the_last_group(monkeypatch):
    made: list = []
    monkeypatch.setattr(wire, "host_store", lambda *a, **k: SimpleNamespace(port=1))
    monkeypatch.setattr(wire, "open_group", _opener(made, GlooGroup, _gloo_released))
    monkeypatch.setattr("ray.get", lambda refs, timeout=None: refs)
    t = GlooTransport(bucket_bytes=1 << 20, checksum_algo="blocksum", timeout_s=1.0)
    t.connect([], [], 1)
    t.connect([], [], 1)
    assert [g.shut_down for g in made] == [1, 0] and t.group is made[1]
    first = weakref.ref(made.pop(0))
    assert _gone(first)


def _engine(cls, **attrs):
    engine = cls.__new__(cls)  # no vLLM config, model or GPU
    engine.parallel_config = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    engine.staged = engine.received = None
    for name, value in attrs.items():
        setattr(engine, name, value)
    return engine


def test_nccl_engine_destroys_the_last_communicator_at_init_and_shutdown(monkeypatch):
    from megatron_rl.publish.vllm_nccl import CheckedNCCLWeightTransferEngine

    made: list = []
    monkeypatch.setattr("vllm.distributed.weight_transfer.nccl_engine.worker_init_process_group",
                        _opener(made, Communicator, lambda c: c.destroyed == 1))
    engine = _engine(CheckedNCCLWeightTransferEngine, model_update_group=None)
    info = SimpleNamespace(packed=True, packed_buffer_size_bytes=1 << 20, packed_num_buffers=2, rank_offset=1)
    engine.init_transfer_engine(info)
    engine.init_transfer_engine(info)  # a regroup
    assert [c.destroyed for c in made] == [1, 0] and made[0].group is None
    assert engine.model_update_group is made[1] and engine.rank == 1
    engine.shutdown()
    assert [c.destroyed for c in made] == [1, 1] and engine.model_update_group is None


def test_gloo_engine_releases_the_last_group_at_init_and_shutdown(monkeypatch):
    from megatron_rl.publish import vllm_engine

    made: list = []
    monkeypatch.setattr(vllm_engine, "open_group", _opener(made, GlooGroup, _gloo_released))
    engine = _engine(vllm_engine.GlooWeightTransferEngine, group=None)
    info = vllm_engine.GlooInitInfo(master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2)
    engine.init_transfer_engine(info)
    first = weakref.ref(made[0])
    engine.init_transfer_engine(info)  # a regroup
    assert made[0].shut_down == 1 and engine.group is made[1]
    made.pop(0)
    assert _gone(first)
    engine.shutdown()
    assert made[0].shut_down == 1 and engine.group is None
    second = weakref.ref(made.pop())
    assert _gone(second)
