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
