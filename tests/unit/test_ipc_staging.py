"""The ipc path exports a reusable staging copy, never the learner's parameters (issue 31, item 10).

    python -m pytest tests/unit/test_ipc_staging.py -q

publish/ipc_staging.py on CPU tensors: what the CUDA step would export is recorded by a double, and
its storage pointers are compared with the model's.  At TP1 with bf16 parameters the source yields
views of the live parameters (publish/source.py: no gather, no cast); exporting those every step is
what piles up torch's IPC contexts on memory that never dies.  The retargeted handle is checked
with the formula rebuild_cuda_tensor applies on the engine side.
"""

import pytest
import torch

from megatron_rl.publish.ipc_staging import ALIGN, CudaBlockExports, IpcStaging, retarget
from megatron_rl.publish.manifest import ManifestRecorder

pytestmark = pytest.mark.unit


class Recorder:
    """The CUDA step as a double: remembers every tensor it was asked to export."""

    def __init__(self):
        self.exported = []

    def __call__(self, tensor):
        self.exported.append(tensor)
        return {"GPU-test": (len(self.exported) - 1,)}


def _model():
    """bf16 parameters laid out in one flat buffer, as Megatron's DDP keeps them."""
    buffer = torch.randn(8 * 16 + 16 * 16 + 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    return buffer, [("model.layers.0.mlp.down_proj.weight", buffer[:128].view(8, 16)),
                    ("model.layers.0.mlp.up_proj.weight", buffer[128:384].view(16, 16)),
                    ("model.norm.weight", buffer[384:])]


def _storages(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_exported_tensors_never_alias_the_model_parameters():
    buffer, params = _model()
    recorder = Recorder()
    staging = IpcStaging(recorder, block_bytes=4096)
    meta, handles, views = staging.export(ManifestRecorder(params, 1, checksum_algo="blocksum", bucket_bytes=256))
    assert [m[0] for m in meta] == [n for n, _ in params] and len(handles) == 3
    assert len(recorder.exported) == 3
    assert buffer.untyped_storage().data_ptr() not in _storages(recorder.exported)
    assert _storages(recorder.exported) == {staging.blocks[0].untyped_storage().data_ptr()}
    for (_, want), got in zip(params, views):
        assert torch.equal(got, want) and got.dtype == torch.bfloat16
        assert got.storage_offset() * got.element_size() % ALIGN == 0
    buffer.add_(1)  # the next optimizer step: the exported copy does not move
    assert not torch.equal(views[0], params[0][1])


def test_the_staging_buffer_is_reused_across_publications():
    buffer, params = _model()
    staging = IpcStaging(Recorder(), block_bytes=4096)
    _, _, first = staging.export(params)
    pointers = [v.data_ptr() for v in first]
    buffer.mul_(2)
    _, _, second = staging.export(params)
    assert [v.data_ptr() for v in second] == pointers and len(staging.blocks) == 1
    assert all(torch.equal(v, p) for v, (_, p) in zip(second, params))


def test_blocks_fill_in_order_and_a_larger_tensor_remakes_the_block():
    staging = IpcStaging(Recorder(), block_bytes=1024)
    small = [(f"t{i}", torch.ones(100)) for i in range(5)]  # 400 bytes each: two per 1 KiB block
    _, _, views = staging.export(small)
    assert len(staging.blocks) == 3 and [v.storage_offset() * 4 for v in views] == [0, 512, 0, 512, 0]
    big = [("big", torch.ones(600))]  # 2400 bytes: block 0 is too small and is made anew
    _, _, (view,) = staging.export(big)
    assert staging.blocks[0].numel() == 2400 and len(staging.blocks) == 1 and view.storage_offset() == 0
    staging.release()
    assert staging.blocks == [] and staging.nbytes == 0


def test_a_holder_places_the_same_layout_the_publisher_exports():
    staging = IpcStaging(Recorder(), block_bytes=4096)
    _, params = _model()
    meta, _, views = staging.export(params)
    placed = staging.place(meta)
    assert [(p.data_ptr(), p.dtype, p.shape) for p in placed] == [(v.data_ptr(), v.dtype, v.shape) for v in views]


def test_each_block_is_exported_once_and_each_handle_rebuilds_its_view():
    """CudaBlockExports asks the CUDA step for the whole block once; the handle of a view is that
    export retargeted, and rebuilding it as rebuild_cuda_tensor does gives the view's bytes."""
    blocks_seen = []

    def export_block(whole):
        blocks_seen.append(whole)
        # reduce_tensor's layout for a CUDA tensor, with the storage standing in for the IPC handle
        return {"GPU-test": (type(whole), whole.size(), whole.stride(), 0, torch.storage.TypedStorage, whole.dtype,
                             0, whole.untyped_storage(), whole.numel(), 0, False, "rc", 7, b"ev", True)}

    exports = CudaBlockExports(export_block)
    staging = IpcStaging(exports, block_bytes=4096)
    _, params = _model()
    for _ in range(3):
        _, handles, views = staging.export(params)
    assert len(blocks_seen) == 1 and blocks_seen[0].numel() == 4096
    for handle, view in zip(handles, views):
        args = handle["GPU-test"]
        assert args[11:] == ("rc", 7, b"ev", True)  # the block's one export
        storage = torch.storage.TypedStorage(wrap_storage=args[7], dtype=args[5], _internal=True)
        rebuilt = torch._utils._rebuild_tensor(storage, args[3], args[1], args[2])
        assert rebuilt.data_ptr() == view.data_ptr() and torch.equal(rebuilt, view)
    staging.release()
    assert exports.blocks == {}


def test_retarget_keeps_the_block_fields():
    block = torch.empty(1024, dtype=torch.uint8)
    view = block[256:256 + 64].view(torch.float32).view(4, 4)
    args = (torch.Tensor, block.size(), block.stride(), 0, "S", torch.uint8, 0, b"h", 1024, 512, False, "rc", 3,
            b"e", True)
    out = retarget(args, view)
    assert out[1] == (4, 4) and out[2] == (4, 1) and out[3] == 64 and out[5] == torch.float32
    assert out[4] == "S" and out[6:10] == (0, b"h", 1024, 512) and out[11:] == ("rc", 3, b"e", True)
