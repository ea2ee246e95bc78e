"""Streaming checkpoint files: HFWriter (safetensors shards) and the torch_dist writer/reader.

    python -m pytest tests/unit/test_checkpoint_files.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.conversion.dist_ckpt import DistCheckpointReader, DistCheckpointWriter
from megatron_rl.conversion.hf_io import INDEX_NAME, SINGLE_NAME, HFWriter


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "c": torch.randn(2, 2, generator=g)}


def test_hf_writer_single_file_any_order(tmp_path):
    ts = _tensors()
    w = HFWriter(tmp_path, {n: (tuple(t.shape), t.dtype) for n, t in ts.items()})
    for name in ("c", "a", "b"):  # offsets are planned, so order does not matter
        w.add(name, ts[name])
    assert w.close() == [tmp_path / SINGLE_NAME]
    back = load_file(str(tmp_path / SINGLE_NAME))
    assert sorted(back) == sorted(ts) and all(torch.equal(back[n], ts[n]) and back[n].dtype == ts[n].dtype for n in ts)


def test_hf_writer_shards_and_index(tmp_path):
    ts = _tensors()
    w = HFWriter(tmp_path, {n: (tuple(t.shape), t.dtype) for n, t in ts.items()}, max_shard_bytes=48)
    for name, t in ts.items():
        w.add(name, t)
    files = w.close()
    assert len(files) == 2 and not (tmp_path / SINGLE_NAME).exists()
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ts.values())
    for name, fname in index["weight_map"].items():
        assert torch.equal(load_file(str(tmp_path / fname))[name], ts[name])


def test_hf_writer_refuses_wrong_or_missing_tensors(tmp_path):
    ts = _tensors()
    w = HFWriter(tmp_path, {n: (tuple(t.shape), t.dtype) for n, t in ts.items()})
    with pytest.raises(ValueError, match="'a'|a: got"):
        w.add("a", torch.zeros(3, 4))
    with pytest.raises(KeyError, match="'z'"):
        w.add("z", torch.zeros(1))
    w.add("a", ts["a"])
    with pytest.raises(ValueError, match="written twice"):
        w.add("a", ts["a"])
    with pytest.raises(ValueError, match="never written"):
        w.close()


def test_dist_writer_reader_roundtrip_and_checks(tmp_path):
    w = DistCheckpointWriter(tmp_path / "ok", num_layers=2)
    qkv = [torch.randn(6, 4), torch.randn(6, 4)]
    emb = torch.randn(8, 4)
    w.add("embedding.word_embeddings.weight", emb)
    for i in (1, 0):
        w.add(f"decoder.layers.{i}.self_attention.linear_qkv.weight", qkv[i])
    with pytest.raises(ValueError, match="written twice"):
        w.add("decoder.layers.0.self_attention.linear_qkv.weight", qkv[0])
    with pytest.raises(ValueError, match="layer 2 outside"):
        w.add("decoder.layers.2.self_attention.linear_qkv.weight", qkv[0])
    with pytest.raises(ValueError, match="does not match the other layers"):
        w.add("decoder.layers.0.self_attention.linear_qkv.weight", torch.randn(5, 4).double())
    w.close()
    r = DistCheckpointReader(tmp_path / "ok")
    assert torch.equal(r.tensor("embedding.word_embeddings.weight"), emb)
    assert all(torch.equal(r.tensor(f"decoder.layers.{i}.self_attention.linear_qkv.weight"), qkv[i]) for i in (0, 1))
    assert "decoder.layers.self_attention.linear_qkv._extra_state/shard_1_2" in r.metadata.state_dict_metadata
    with pytest.raises(KeyError, match="output_layer"):
        r.tensor("output_layer.weight")

    partial = DistCheckpointWriter(tmp_path / "partial", num_layers=2)
    partial.add("decoder.layers.0.mlp.linear_fc2.weight", torch.randn(4, 4))
    with pytest.raises(ValueError, match="linear_fc2.weight: chunks cover 16 of 32"):
        partial.close()
    with pytest.raises(FileNotFoundError, match="no metadata.json"):
        DistCheckpointReader(tmp_path / "partial")


def test_dist_reader_reads_into_reused_buffers_with_the_same_values(tmp_path):
    """With alloc (LayerBuffers.get), each chunk's bytes go straight into the buffer: layer 1 lands in
    layer 0's memory, bf16 and expert tensors too, values identical to the plain read."""
    from megatron_rl.conversion.mapping import LayerBuffers

    w = DistCheckpointWriter(tmp_path / "ck", num_layers=2, num_experts=2)
    names = ["decoder.layers.{i}.self_attention.linear_qkv.weight", "decoder.layers.{i}.mlp.router.weight",
             "decoder.layers.{i}.mlp.experts.local_experts.1.linear_fc1.weight"]
    dtypes = [torch.float32, torch.bfloat16, torch.float32]
    for i in (0, 1):
        for e in (0, 1):
            w.add(f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight", torch.randn(6, 4))
        for n, dt in zip(names[:2], dtypes):
            w.add(n.format(i=i), torch.randn(6, 4).to(dt))
    w.add("embedding.word_embeddings.weight", torch.randn(8, 4))
    w.close()
    r = DistCheckpointReader(tmp_path / "ck")
    buffers, pointers = LayerBuffers(), []
    for i in (0, 1):
        for n, dt in zip(names, dtypes):
            got = r.tensor(n.format(i=i), buffers.get)
            assert got.dtype == dt and torch.equal(got, r.tensor(n.format(i=i))), n
            pointers.append(got.data_ptr())
    assert pointers[:3] == pointers[3:] and len(set(pointers)) == 3
    emb = r.tensor("embedding.word_embeddings.weight", buffers.get)
    assert torch.equal(emb, r.tensor("embedding.word_embeddings.weight"))


def test_dist_reader_data_offset_only_for_a_plain_contiguous_tensor():
    """The raw read is used only where the pickle says: one contiguous tensor of the expected dtype and
    shape over its whole storage; a transposed, offset or other-dtype tensor falls back to torch.load."""
    import io

    from megatron_rl.conversion.dist_ckpt import _data_offset

    def saved(t):
        buf = io.BytesIO()
        torch.save(t, buf)
        buf.seek(0)
        return buf

    t = torch.randn(3, 5)
    where = _data_offset(saved(t), torch.float32, (3, 5))
    raw = saved(t).getvalue()[where:where + t.numel() * 4]
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32).view(3, 5), t)
    assert _data_offset(saved(torch.randn(5, 3).T), torch.float32, (3, 5)) is None  # transposed storage
    assert _data_offset(saved(t), torch.float64, (3, 5)) is None
    assert _data_offset(saved(t), torch.float32, (5, 3)) is None
    assert _data_offset(saved(torch.randn(4, 5)[1:]), torch.float32, (3, 5)) is None  # storage larger, offset
