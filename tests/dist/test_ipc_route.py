"""Colocated IPC on several GPUs, on CPU: the route, the copies and the handle union across gloo ranks.

    /work/heavy .venv/bin/python -m pytest tests/dist/test_ipc_route.py -q     (or plain pytest)

Three learner ranks (gloo, run_distributed) stand on two GPUs: rank 0 (the publisher) and rank 2
on "GPU-A", rank 1 on "GPU-B"; rollout group 0 runs on GPU-A, group 1 on GPU-B.  Everything of
publish/ipc_route.py runs for real: the route planned over the learner group (and refused, on
every rank, for an engine GPU no learner rank is on), the publisher's hashing and export, the
byte-for-byte copy broadcast to the holder, the gathered handles and their union, the release.
Only the CUDA IPC step is a test double (`SharedMemoryHandles`): a tensor is exported as a named
POSIX shared-memory segment (torch's file_system sharing) keyed by the fake GPU UUID of the rank
that exports it, and an engine opens the segment of its own GPU from any process, as a CUDA IPC
handle opens memory on the engine's GPU.  The two engines are vLLM-less doubles of
CheckedIPCWeightTransferEngine (as in tests/unit/test_publish_ipc.py) driven by the publisher:
engine B therefore reads memory that lives in rank 1's process.
"""

import pytest
import torch

from megatron_rl.platform.spawn import run_distributed

pytestmark = pytest.mark.dist

GPUS = {0: "GPU-A", 1: "GPU-B", 2: "GPU-A"}  # learner rank -> its (fake) GPU
ENGINES = [["GPU-A"], ["GPU-B"]]  # rollout group -> its workers' GPUs
TENSORS = 5
CORRUPT_CALL = TENSORS + 2  # rank 1's exporter flips a byte of the third tensor of the second publication


class SharedMemoryHandles:
    """The CUDA step as a double: export = a shared-memory segment name under this rank's GPU UUID."""

    def __init__(self, uuid: str, corrupt_call: int | None = None):
        self.uuid, self.corrupt_call, self.calls = uuid, corrupt_call, 0

    def export(self, tensor):
        if self.calls == self.corrupt_call:
            tensor.view(-1).view(torch.uint8)[3] ^= 0x20  # this GPU's copy differs from what was hashed
        self.calls += 1
        manager, name, size = tensor.untyped_storage()._share_filename_cpu_()
        return {self.uuid: (manager, name, size, str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
                            tensor.storage_offset())}

    @staticmethod
    def opener(uuid: str):
        def open_handle(handle, device):
            if uuid not in handle:
                raise ValueError(f"no IPC handle for this engine's GPU {uuid} (handles are for {sorted(handle)})")
            manager, name, size, dtype, shape, offset = handle[uuid]  # a view of a staging block
            storage = torch.UntypedStorage._new_shared_filename_cpu(manager, name, size)
            return torch.empty(0, dtype=getattr(torch, dtype)).set_(storage, offset, shape)
        return open_handle


def _weights(version: int):
    g = torch.Generator().manual_seed(version)
    return [(f"model.layers.{i}.mlp.down_proj.weight", torch.randn(8, 16, generator=g).to(torch.bfloat16))
            for i in range(TENSORS - 1)] + [("model.norm.weight", torch.full((16,), float(version), dtype=torch.bfloat16))]


def _engine(model_dir: str, uuid: str):
    from types import SimpleNamespace

    from megatron_rl.publish.vllm_ipc import CheckedIPCWeightTransferEngine

    class Engine(CheckedIPCWeightTransferEngine):
        def __init__(self):  # vLLM's engine __init__ needs a whole VllmConfig: set what is read
            self.model_config = SimpleNamespace(model=model_dir, dtype=torch.bfloat16)  # no config.json
            self.parallel_config = SimpleNamespace(rank=0, world_size=1, data_parallel_index=0)
            self.device = torch.device("cpu")
            self.loads, self.model = [], None
            self._init_commit()
            self.weights.install = self._record  # the model: records a copy of what it was given
            self._init_ipc(opener=SharedMemoryHandles.opener(uuid))

        def _record(self, version, tensors):
            self.loads.append([(n, t.clone()) for n, t in tensors])

    engine = Engine()
    engine.init_transfer_engine(SimpleNamespace(packed=False, rank_offset=1))
    return engine


def _deliver_to(engines, version):
    """What WeightPublisher's deliver does through Ray: each group receives the pickled union and verifies."""
    from megatron_rl.publish.vllm_ipc import CheckedIPCUpdateInfo

    def deliver(meta, pickled, manifest):
        answers = []
        for engine in engines:
            info = CheckedIPCUpdateInfo(names=[m[0] for m in meta], dtype_names=[m[1] for m in meta],
                                        shapes=[m[2] for m in meta], ipc_handles_pickled=pickled, version=version)
            engine.start_weight_update()
            engine.receive_weights(info)
            engine.verify(manifest.to_dict())
            engine.finish_weight_update()
            answers.append(dict(engine.status))
        return answers
    return deliver


def _failing_source():
    yield from _weights(3)[:2]
    raise RuntimeError("gather failed (injected)")


def _publisher(replicas, exporter, model_dir):
    from megatron_rl.publish.ipc_route import ipc_round
    from megatron_rl.publish.ipc_staging import IpcStaging
    from megatron_rl.publish.manifest import ManifestRecorder

    engines = [_engine(model_dir, gpus[0]) for gpus in ENGINES]
    out = {}
    staging = IpcStaging(exporter.export)
    for version in (1, 2, 3, 4):
        source = _failing_source() if version == 3 else _weights(version)
        recorder = ManifestRecorder(source, version, checksum_algo="blocksum", bucket_bytes=600)
        try:
            _, answers = ipc_round(recorder, _deliver_to(engines, version), staging, replicas)
        except RuntimeError as err:
            out[version] = str(err)
            continue
        out[version] = [{k: a.get(k) for k in ("committed", "bad_bucket", "error")} for a in answers]
    out["loads"] = [[[(n, t) for n, t in load] for load in e.loads] for e in engines]
    return out


def _route_and_publish(rank, world_size, model_dir):
    import os

    from megatron_rl.config import ConfigError
    from megatron_rl.publish.ipc_route import IPCReplicas
    from megatron_rl.publish.ipc_staging import IpcStaging

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # what the ipc engine's env sets (rollout/engine_setup.py)
    out = {}
    try:  # a group with a worker on GPU-C, where no learner rank runs
        IPCReplicas.connect(lambda: [["GPU-A"], ["GPU-B", "GPU-C"]], GPUS[rank])
    except ConfigError as err:
        out["refused"] = str(err)
    exporter = SharedMemoryHandles(GPUS[rank], CORRUPT_CALL if rank == 1 else None)
    replicas = IPCReplicas.connect(lambda: ENGINES, GPUS[rank], staging=IpcStaging(exporter.export))
    out["route"] = (dict(replicas.route.source_of), replicas.route.ranks)
    if rank == 0:
        out.update(_publisher(replicas, exporter, model_dir))
    else:
        out["held"] = [replicas.hold() for _ in range(4)]
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_route_and_publish, 3, str(tmp_path_factory.mktemp("engine")), timeout=240)


def test_an_engine_gpu_without_a_learner_rank_is_refused_on_every_rank_naming_it(ranks):
    for out in ranks:
        assert "rollout group(s) [1]" in out["refused"] and "group 1 on GPU-C" in out["refused"]
        assert "rollout.weight_transfer 'ipc'" in out["refused"]


def test_the_route_has_one_copy_per_engine_gpu(ranks):
    for out in ranks:
        assert out["route"] == ({"GPU-A": 0, "GPU-B": 1}, (0, 1))
    model_bytes = sum(t.numel() * t.element_size() for _, t in _weights(1))
    assert ranks[1]["held"] == [model_bytes, model_bytes, 0, model_bytes]  # 0: the publisher's source failed
    assert ranks[2]["held"] == [0, 0, 0, 0]  # on the publisher's GPU: no copy of its own


def test_each_engine_opens_its_own_gpus_copy_and_commits_the_hashed_bytes(ranks):
    pub = ranks[0]
    assert pub[1] == [{"committed": True, "bad_bucket": None, "error": None}] * 2
    want = _weights(1)
    for engine_loads in pub["loads"]:
        loaded = engine_loads[0]
        assert [n for n, _ in loaded] == [n for n, _ in want]
        assert all(got.dtype == torch.bfloat16 and torch.equal(got, w) for (_, got), (_, w) in zip(loaded, want))


def test_a_corrupted_copy_on_one_gpu_is_refused_by_its_engine_only(ranks):
    on_a, on_b = ranks[0][2]
    assert on_a["committed"] is True
    assert on_b["committed"] is False and on_b["bad_bucket"] is not None and "mismatch" in on_b["error"]
    assert len(ranks[0]["loads"][0]) == 3 and len(ranks[0]["loads"][1]) == 2  # B loaded versions 1 and 4 only


def test_a_failed_source_releases_the_holders_and_the_next_publication_commits(ranks):
    assert "gather failed (injected)" in ranks[0][3]
    assert ranks[0][4] == [{"committed": True, "bad_bucket": None, "error": None}] * 2
    for engine_loads in ranks[0]["loads"]:
        assert torch.equal(engine_loads[-1][-1][1], _weights(4)[-1][1])
