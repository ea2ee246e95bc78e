"""Publication communicators are freed, not leaked (issue 31 item 7): a regroup (a second connect)
and a learner rank rebuilt for the next run destroy the communicator of the last group.

    python -m pytest tests/unit/test_transport_close.py -q

The NCCL communicator is replaced by a double counting destroy() calls (no GPU here); the real
LearnerWorker code paths run.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.publish import trainer
from megatron_rl.publish.transports import NcclTransport
from megatron_rl.train.learner_rank import LearnerWorker
from megatron_rl.train.learner_weights import PublishSettings

pytestmark = pytest.mark.unit


class Communicator:
    def __init__(self):
        self.destroyed = 0

    def destroy(self):
        self.destroyed += 1


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
