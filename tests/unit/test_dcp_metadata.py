"""The checkpoint `.metadata` pickle written without torch.distributed.checkpoint equals torch's own."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

from megatron_rl.conversion import dcp_metadata as md

pytestmark = pytest.mark.unit


def _ours():
    entries = {
        "decoder.layers.mlp.linear_fc1.weight": md.TensorStorageMetadata(
            md.TensorProperties(torch.bfloat16), torch.Size((2, 8, 4)),
            [md.ChunkStorageMetadata(torch.Size((i, 0, 0)), torch.Size((1, 8, 4))) for i in range(2)]),
        "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2": md.BytesStorageMetadata(),
    }
    storage = {md.MetadataIndex("decoder.layers.mlp.linear_fc1.weight", (i, 0, 0)): md.StorageInfo("__0_0.distcp", 100 * i, 90)
               for i in range(2)}
    storage[md.MetadataIndex("decoder.layers.mlp.linear_fc1._extra_state/shard_0_2")] = md.StorageInfo("__0_0.distcp", 200, 7)
    return md.Metadata(entries, storage, md.StorageMeta(checkpoint_id="ckpt", save_id="abc"))


def _torchs():
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as tm

    entries = {
        "decoder.layers.mlp.linear_fc1.weight": tm.TensorStorageMetadata(
            tm.TensorProperties(dtype=torch.bfloat16), torch.Size((2, 8, 4)),
            [tm.ChunkStorageMetadata(offsets=torch.Size((i, 0, 0)), sizes=torch.Size((1, 8, 4))) for i in range(2)]),
        "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2": tm.BytesStorageMetadata(),
    }
    storage = {tm.MetadataIndex("decoder.layers.mlp.linear_fc1.weight", torch.Size((i, 0, 0))): fs._StorageInfo("__0_0.distcp", 100 * i, 90)
               for i in range(2)}
    storage[tm.MetadataIndex("decoder.layers.mlp.linear_fc1._extra_state/shard_0_2", None)] = fs._StorageInfo("__0_0.distcp", 200, 7)
    metadata = tm.Metadata(state_dict_metadata=entries, planner_data=None, storage_data=storage,
                           storage_meta=tm.StorageMeta(checkpoint_id="ckpt", save_id="abc"))
    metadata.version = fs.CURRENT_DCP_VERSION
    return metadata


def test_the_bytes_equal_pickle_of_torchs_own_metadata():
    assert md.dumps(_ours()) == pickle.dumps(_torchs())


def test_torch_unpickles_them_into_its_own_classes_with_the_same_values():
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as tm

    back = pickle.loads(md.dumps(_ours()))
    assert type(back) is tm.Metadata and back == _torchs()
    info = back.storage_data[tm.MetadataIndex("decoder.layers.mlp.linear_fc1.weight", (1, 0, 0))]
    assert type(info) is fs._StorageInfo and (info.offset, info.length) == (100, 90)
    assert back.state_dict_metadata["decoder.layers.mlp.linear_fc1.weight"].properties.memory_format is torch.contiguous_format


def test_reading_torchs_file_gives_these_classes_and_finds_chunks_by_key(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(_torchs()))
    back = md.load(path)
    entry = back.state_dict_metadata["decoder.layers.mlp.linear_fc1.weight"]
    assert isinstance(entry, md.TensorStorageMetadata) and entry.properties.dtype is torch.bfloat16
    assert [tuple(c.offsets) for c in entry.chunks] == [(0, 0, 0), (1, 0, 0)]
    assert back.storage_data[md.MetadataIndex("decoder.layers.mlp.linear_fc1.weight", torch.Size((1, 0, 0)))].offset == 100
    assert back.storage_data[md.MetadataIndex("decoder.layers.mlp.linear_fc1._extra_state/shard_0_2")].length == 7
    assert md.MetadataIndex("decoder.layers.mlp.linear_fc1.weight", (0, 0, 0)) not in {
        md.MetadataIndex("decoder.layers.mlp.linear_fc1.weight", (1, 0, 0))}


def test_a_conversion_round_trip_never_imports_torch_distributed_checkpoint(tmp_path):
    code = f"""
import sys, torch
from megatron_rl.conversion.dist_ckpt import DistCheckpointReader, DistCheckpointWriter
w = DistCheckpointWriter({str(tmp_path)!r}, num_layers=2)
for i in range(2):
    w.add(f"decoder.layers.{{i}}.mlp.linear_fc1.weight", torch.full((3, 2), float(i)))
w.add("embedding.word_embeddings.weight", torch.ones(5, 2))
w.close()
r = DistCheckpointReader({str(tmp_path)!r})
assert r.tensor("decoder.layers.1.mlp.linear_fc1.weight").eq(1).all()
assert r.tensor("embedding.word_embeddings.weight").shape == (5, 2)
print(sorted(m for m in sys.modules if m.startswith("torch.distributed.checkpoint")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
