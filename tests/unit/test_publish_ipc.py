"""The ipc transport's verify-before-commit, on CPU (publish/vllm_ipc.py, issue 18).

    python -m pytest tests/unit/test_publish_ipc.py -q

CUDA IPC itself needs a GPU.  Everything around it runs here for real: the trainer's hashing
(ManifestRecorder) and export (export_ipc_handles), the engine's receive, its check against the
manifest, and its all-or-nothing commit.  Only the CUDA handle step is a test double: `Handles`
exports a tensor as a key and opens it as that very tensor (same memory, as CUDA IPC gives the
engine), so a byte the trainer changes after hashing is a byte the engine reads.  The engine's
model is replaced by a recorder of what `finish_weight_update` loads (vLLM's layerwise reload
needs a real vLLM model).
"""

import base64
import pickle
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.publish.ipc_staging import IpcStaging
from megatron_rl.publish.manifest import ManifestRecorder

pytestmark = pytest.mark.unit

UUID = "GPU-test"


class Handles:
    """The CUDA step as a double: export = a key into this table, open = the same tensor object."""

    def __init__(self, fail_on: str | None = None):
        self.table, self.fail_on, self.names = {}, fail_on, {}

    def export(self, tensor):
        key = len(self.table)
        self.table[key] = tensor
        return {UUID: (key,)}

    def open(self, handle, device):
        (key,) = handle[UUID]
        if self.fail_on is not None and key == self.fail_on:
            raise ValueError("no IPC handle for this engine's GPU (injected)")
        return self.table[key]


def _engine(tmp_path, handles, dtype=torch.float32):
    from megatron_rl.publish.vllm_ipc import CheckedIPCWeightTransferEngine

    class Engine(CheckedIPCWeightTransferEngine):
        def __init__(self):  # vLLM's engine __init__ needs a whole VllmConfig: set what is read
            self.model_config = SimpleNamespace(model=str(tmp_path), dtype=dtype)  # no config.json
            self.parallel_config = SimpleNamespace(rank=0, world_size=1, data_parallel_index=0)
            self.device = torch.device("cpu")
            self.loads, self.model = [], None
            self._init_commit()
            self.weights.install = lambda version, tensors: self.loads.append(list(tensors))  # the model: records
            self._init_ipc(opener=handles.open)

    engine = Engine()
    engine.init_transfer_engine(SimpleNamespace(packed=False, rank_offset=1))
    return engine


def _weights(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [(f"model.layers.{i}.mlp.down_proj.weight", torch.randn(8, 16, generator=g).to(dtype)) for i in range(4)] + \
        [("model.norm.weight", torch.ones(16, dtype=dtype))]


def _publish(engine, handles, weights, version=1, after_export=None):
    """The trainer's half (WeightPublisher._publish_ipc without Ray) and the engine's half."""
    from megatron_rl.publish.vllm_ipc import CheckedIPCUpdateInfo, export_ipc_handles

    recorder = ManifestRecorder(weights, version, checksum_algo="blocksum", bucket_bytes=1024)
    meta, exported, keep = export_ipc_handles(recorder, IpcStaging(handles.export))
    manifest = recorder.manifest()
    if after_export is not None:
        after_export(keep)
    info = CheckedIPCUpdateInfo(names=[m[0] for m in meta], dtype_names=[m[1] for m in meta],
                                shapes=[m[2] for m in meta], ipc_handles=exported, version=version)
    engine.start_weight_update()
    engine.receive_weights(info)
    engine.verify(manifest.to_dict())
    engine.finish_weight_update()
    return manifest, keep


def test_intact_publication_commits_reading_the_trainers_memory(tmp_path):
    handles = Handles()
    engine = _engine(tmp_path, handles)
    weights = _weights()
    manifest, keep = _publish(engine, handles, weights)
    assert len(manifest.buckets) > 1
    assert engine.status["committed"] is True and engine.status["ok"] is True and engine.status["rank"] == 1
    (loaded,) = engine.loads
    assert [n for n, _ in loaded] == [n for n, _ in weights]
    for (_, got), (_, want), held in zip(loaded, weights, keep):
        assert torch.equal(got, want) and got.data_ptr() == held.data_ptr()  # in place, no copy
    assert engine.received is None


def test_bytes_changed_after_hashing_are_refused_and_nothing_loads(tmp_path):
    """The trainer's memory changes between hashing and the engine's read (a stray write, a
    buffer reused too early): the engine's digest over what it would load differs."""
    handles = Handles()
    engine = _engine(tmp_path, handles)

    def stray_write(keep):
        keep[2][3, 5] += 1.0

    _publish(engine, handles, _weights(), after_export=stray_write)
    assert engine.status["committed"] is False and engine.status["ok"] is False
    assert engine.status["bad_bucket"] is not None and "mismatch" in engine.status["error"]
    assert engine.loads == []


def test_corruption_injected_after_hashing_is_refused(tmp_path):
    """The same fault hook the gloo and NCCL tests use: bytes flipped in a bucket after its digest."""
    handles = Handles()
    engine = _engine(tmp_path, handles)
    from megatron_rl.publish.vllm_ipc import CheckedIPCUpdateInfo, export_ipc_handles

    def flip(spec, buf):
        if spec.index == 1:
            buf[buf.numel() // 2] ^= 0x10

    recorder = ManifestRecorder(_weights(), 2, checksum_algo="blocksum", bucket_bytes=1024, fault_hook=flip)
    meta, exported, _keep = export_ipc_handles(recorder, IpcStaging(handles.export))
    info = CheckedIPCUpdateInfo(names=[m[0] for m in meta], dtype_names=[m[1] for m in meta],
                                shapes=[m[2] for m in meta], ipc_handles=exported, version=2)
    engine.start_weight_update()
    engine.receive_weights(info)
    engine.verify(recorder.manifest().to_dict())
    engine.finish_weight_update()
    assert engine.status["committed"] is False and engine.status["bad_bucket"] == 1
    assert engine.loads == []


def test_a_handle_that_cannot_be_opened_is_refused_naming_the_tensor(tmp_path):
    handles = Handles(fail_on=3)
    engine = _engine(tmp_path, handles)
    _publish(engine, handles, _weights())
    assert engine.status["committed"] is False
    assert "could not open the IPC handle of model.layers.3.mlp.down_proj.weight" in engine.status["error"]
    assert engine.loads == []


def test_a_handle_holding_other_than_announced_is_refused(tmp_path):
    from megatron_rl.publish.vllm_ipc import CheckedIPCUpdateInfo

    handles = Handles()
    engine = _engine(tmp_path, handles)
    weights = _weights()
    exported = [handles.export(t) for _, t in weights]
    shapes = [list(t.shape) for _, t in weights]
    shapes[0] = [16, 8]
    info = CheckedIPCUpdateInfo(names=[n for n, _ in weights], dtype_names=["float32"] * len(weights),
                                shapes=shapes, ipc_handles=exported, version=1)
    engine.start_weight_update()
    engine.receive_weights(info)
    engine.verify({"version": 1})  # whatever the manifest: the open already failed
    engine.finish_weight_update()
    assert "holds float32 [8, 16], announced float32 [16, 8]" in engine.status["error"]
    assert engine.loads == []


def test_a_publication_in_another_dtype_is_refused(tmp_path):
    handles = Handles()
    engine = _engine(tmp_path, handles, dtype=torch.bfloat16)
    _publish(engine, handles, _weights(torch.float32))
    assert engine.status["committed"] is False and "bfloat16" in engine.status["error"]
    assert engine.loads == []


def test_an_unverified_publication_leaves_no_view_behind(tmp_path):
    """finish without verify (the group dropped it): nothing loads and no view of the trainer's
    memory stays in the engine, so the trainer may free it."""
    from megatron_rl.publish.vllm_ipc import CheckedIPCUpdateInfo

    handles = Handles()
    engine = _engine(tmp_path, handles)
    weights = _weights()
    info = CheckedIPCUpdateInfo(names=[n for n, _ in weights], dtype_names=["float32"] * len(weights),
                                shapes=[list(t.shape) for _, t in weights],
                                ipc_handles=[handles.export(t) for _, t in weights], version=1)
    engine.start_weight_update()
    engine.receive_weights(info)
    assert engine.received is not None
    engine.finish_weight_update()
    assert engine.received is None and engine.staged is None and engine.loads == []
    assert engine.status.get("committed") is False


def test_packed_ipc_is_refused(tmp_path):
    engine = _engine(tmp_path, Handles())
    with pytest.raises(ValueError, match="refuses packed IPC"):
        engine.init_transfer_engine(SimpleNamespace(packed=True, rank_offset=0))


def test_handles_travel_pickled_as_vllm_reads_them(monkeypatch):
    """The worker passes the trainer's string on as `ipc_handles_pickled`; vLLM's update info
    unpickles it (only with VLLM_ALLOW_INSECURE_SERIALIZATION, which the ipc engine env sets)."""
    from megatron_rl.publish.vllm_ipc import CheckedIPCUpdateInfo, pickle_handles

    handles = [{UUID: (0, "x")}, {UUID: (1, "y")}]
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    info = CheckedIPCUpdateInfo(names=["a", "b"], dtype_names=["float32"] * 2, shapes=[[1], [2]],
                                ipc_handles_pickled=pickle_handles(handles), version=3)
    assert info.ipc_handles == handles and info.version == 3


def test_the_route_names_one_learner_rank_per_engine_gpu():
    """8 learner ranks on 4 GPUs (two per GPU), engines on all 4, one of them TP2 over two GPUs:
    the publisher serves its own GPU, the lowest rank on each other GPU holds that GPU's copy."""
    from megatron_rl.publish.ipc_route import plan_route

    learners = ["G0", "G0", "G1", "G1", "G2", "G2", "G3", "G3"]
    route = plan_route(learners, [["G0"], ["G1"], ["G2", "G3"]])
    assert route.source_of == {"G0": 0, "G1": 2, "G2": 4, "G3": 6}
    assert route.holders == (2, 4, 6) and route.ranks == (0, 2, 4, 6)
    alone = plan_route(["G0"], [["G0"], ["G0"]])
    assert alone.holders == () and alone.source_of == {"G0": 0}


def test_engine_gpus_without_a_learner_rank_are_refused_naming_groups_and_gpus():
    from megatron_rl.config import ConfigError
    from megatron_rl.publish.ipc_route import IPCReplicas, plan_route

    with pytest.raises(ConfigError) as err:
        plan_route(["G0", "G1"], [["G0"], ["G1", "G5"], ["G7"]])
    msg = str(err.value)
    assert "rollout.weight_transfer 'ipc'" in msg and "rollout group(s) [1, 2]" in msg
    assert "group 1 on G5; group 2 on G7" in msg and "['G0', 'G1']" in msg
    with pytest.raises(ConfigError, match="group 1 on G1"):  # a publisher alone serves its GPU only
        IPCReplicas.local([["G0"], ["G1"]], "G0")


def test_a_publisher_alone_shares_nothing_and_sends_its_own_handles(tmp_path):
    """One GPU: ipc_round sends the publisher's handles unchanged and needs no process group."""
    from megatron_rl.publish.ipc_route import IPCReplicas, ipc_round

    handles = Handles()
    replicas = IPCReplicas.local([[UUID]], UUID)
    sent = []

    def deliver(meta, pickled, manifest):
        sent.append(pickled)
        return [{"committed": True}]

    recorder = ManifestRecorder(_weights(), 1, checksum_algo="blocksum", bucket_bytes=1024)
    manifest, answers = ipc_round(recorder, deliver, IpcStaging(handles.export), replicas)
    assert answers == [{"committed": True}] and len(manifest.tensor_names) == 5 and not replicas.shared
    assert pickle.loads(base64.b64decode(sent[0])) == [{UUID: (k,)} for k in range(5)]
