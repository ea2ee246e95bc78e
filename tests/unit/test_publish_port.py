"""The gloo publication group's port cannot be taken between choosing and binding it.

    python -m pytest tests/unit/test_publish_port.py -q

The trainer used to probe a free port, tell the rollout workers, then bind it: on a busy machine
another process could take it in between (EADDRINUSE, seen once in a run).  Now rank 0's store
listens first (port 0: the OS picks and binds at once) and the workers are told the bound port.
The race is injected by making the free-port probe return a port someone else holds; the
receiving side is a Ray actor that joins the group with the real wire protocol and gets one
publication (no vLLM: the engine side of the protocol is tested in tests/dist and tests/e2e).
"""

import socket

import pytest
import ray
import torch

from megatron_rl.platform import spawn as spawn_mod
from megatron_rl.publish.trainer import WeightPublisher

pytestmark = pytest.mark.unit


@ray.remote(num_cpus=0)
class _Receiver:
    def engine_world_size(self) -> int:
        return 1

    def init_weight_transfer(self, info: dict) -> None:
        from megatron_rl.publish.wire import open_group

        self.group = open_group(info["master_address"], info["master_port"], info["rank_offset"],
                                info["world_size"], info["timeout_s"])

    def receive_weights(self, version: int) -> dict:
        from megatron_rl.publish.wire import StagingBuffers, receive_publication

        received = receive_publication(self.group, StagingBuffers())
        ok = received.error is None and received.manifest.version == version
        return {"committed": ok, "error": received.error, "sum": float(sum(t.sum() for _, t in received.tensors))}


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_port_taken_after_the_probe_does_not_break_the_group(ray_local, monkeypatch):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    monkeypatch.setattr(spawn_mod, "free_port", lambda host="127.0.0.1": squatter.getsockname()[1])
    try:
        publisher = WeightPublisher(transport="gloo", timeout_s=60)
        publisher.connect([_Receiver.remote()])
        report = publisher.publish(1, [[("w", torch.arange(6, dtype=torch.float32))]])
        assert report.committed and report.results[0]["sum"] == 15.0  # every byte arrived and verified
    finally:
        squatter.close()
