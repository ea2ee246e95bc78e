"""A manifest that travels apart from the tensors (the NCCL path), checked on CPU.

    python -m pytest tests/unit/test_publish_separate_manifest.py -q

ManifestRecorder hashes tensors as they pass to a transport; verify_tensors checks what a
receiver kept against it; the trainer refuses to send what it did not announce; and the
NCCL engine's verify step stages a publication only when all of it matches.  The NCCL
transfer itself needs two GPUs (tests/gpu/test_gpu_publish_nccl.py).
"""

import pytest
import torch

from megatron_rl.publish.manifest import (
    ManifestRecorder,
    PublicationManifest,
    pack_bucket,
    plan_buckets,
    verify_tensors,
)
from megatron_rl.publish.trainer import WeightPublisher
from megatron_rl.publish.transports import announced_metadata, as_announced

pytestmark = pytest.mark.unit

BUCKET = 1024


def _groups():
    g = torch.Generator().manual_seed(3)
    return [
        [("model.embed_tokens.weight", torch.randn(16, 8, generator=g))],  # 512 B
        [("model.layers.0.q.weight", torch.randn(8, 8, generator=g).to(torch.bfloat16)),  # 128 B
         ("model.layers.0.up.weight", torch.randn(24, 8, generator=g))],  # 768 B
        [("model.norm.weight", torch.randn(400, generator=g))],  # 1600 B, a bucket of its own
    ]


def _flat(groups):
    return [pair for group in groups for pair in group]


def _record(groups, **kw):
    recorder = ManifestRecorder(groups, version=7, bucket_bytes=BUCKET, **kw)
    passed = [(name, t.clone()) for name, t in recorder]
    return recorder.manifest(), passed


def test_recorder_passes_tensors_unchanged_and_digests_equal_the_wire_path():
    groups = _groups()
    manifest, passed = _record(groups)
    assert [n for n, _ in passed] == [n for n, _ in _flat(groups)]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(passed, _flat(groups)))
    assert manifest.version == 7 and manifest.tensor_names == [n for n, _ in _flat(groups)]
    # Same buckets and digests as the gloo wire computes (pack_bucket is its reference).
    wire = [pack_bucket(i, items, "blocksum")[0] for i, items in enumerate(plan_buckets(_flat(groups), BUCKET))]
    assert manifest.buckets == tuple(wire)
    assert PublicationManifest.from_dict(manifest.to_dict()) == manifest
    assert verify_tensors(manifest, passed) == (None, None)


def test_manifest_is_known_only_after_every_tensor_passed():
    recorder = ManifestRecorder(_groups(), version=1, bucket_bytes=BUCKET)
    it = iter(recorder)
    next(it)
    with pytest.raises(RuntimeError, match="only after every tensor"):
        recorder.manifest()
    with pytest.raises(ValueError, match="checksum algorithm 'md5'"):
        ManifestRecorder(_groups(), version=1, checksum_algo="md5")


@pytest.mark.parametrize("algo", ["blocksum", "blake3"])
def test_verify_names_the_bucket_of_a_changed_word(algo):
    manifest, passed = _record(_groups(), checksum_algo=algo)
    name, t = passed[2]  # model.layers.0.up.weight, bucket 1
    t.view(-1)[5] += 1.0
    problem, bad = verify_tensors(manifest, passed)
    assert bad == 1 and "bucket 1" in problem and f"{algo} mismatch" in problem


def test_verify_refuses_missing_extra_reordered_and_retyped_tensors():
    manifest, passed = _record(_groups())
    problem, bad = verify_tensors(manifest, passed[:-1])
    assert bad == 2 and "model.norm.weight never arrived" in problem
    problem, bad = verify_tensors(manifest, passed + [("lm_head.weight", torch.zeros(2))])
    assert "lm_head.weight" in problem and "beyond" in problem
    swapped = [passed[0], passed[2], passed[1], passed[3]]
    problem, bad = verify_tensors(manifest, swapped)
    assert bad == 0 and "expected model.layers.0.q.weight" in problem  # buckets: [embed, q], [up], [norm]
    retyped = [(n, t.float() if t.dtype == torch.bfloat16 else t) for n, t in passed]
    problem, bad = verify_tensors(manifest, retyped)
    assert bad == 0 and "bfloat16" in problem and "float32" in problem


def test_fault_hook_corrupts_what_is_passed_on_not_what_was_hashed():
    def corrupt(spec, buf):
        if spec.index == 1:
            buf[3] ^= 0x01

    manifest, passed = _record(_groups(), fault_hook=corrupt)
    clean, _ = _record(_groups())
    assert manifest == clean  # digests of the tensors as they were
    problem, bad = verify_tensors(manifest, passed)
    assert bad == 1 and "mismatch" in problem


def test_trainer_announces_before_sending_and_refuses_to_send_anything_else():
    groups = _groups()
    meta = announced_metadata(groups)
    assert meta[1] == ("model.layers.0.q.weight", "bfloat16", [8, 8])
    assert list(as_announced(iter(_flat(groups)), meta)) == _flat(groups)
    with pytest.raises(ValueError, match=r"tensor 1 is model.layers.0.up.weight .* told \('model.layers.0.q.weight'"):
        list(as_announced(iter([p for i, p in enumerate(_flat(groups)) if i != 1]), meta))
    with pytest.raises(ValueError, match="3 tensors sent, the receivers were told 4"):
        list(as_announced(iter(_flat(groups)[:3]), meta))
    with pytest.raises(TypeError, match="announces every tensor before sending"):
        announced_metadata(iter(_flat(groups)))
    with pytest.raises(ValueError, match="'model.norm.weight' appears twice"):
        announced_metadata(groups + [groups[-1]])
    with pytest.raises(ValueError, match="transport 'ib'"):
        WeightPublisher(transport="ib")


def test_nccl_engine_stages_only_a_publication_that_verifies():
    """The verify step of CheckedNCCLWeightTransferEngine, without vLLM or a GPU behind it."""
    from megatron_rl.publish.vllm_reload import FullWeights
    from megatron_rl.publish.vllm_nccl import CheckedNCCLWeightTransferEngine

    groups = _groups()
    expected = {n: tuple(t.shape) for n, t in _flat(groups)}
    manifest, passed = _record(groups)

    def engine_holding(version, tensors):
        engine = CheckedNCCLWeightTransferEngine.__new__(CheckedNCCLWeightTransferEngine)  # no vLLM config
        engine.rank, engine.staged = 3, None
        engine.weights = FullWeights(None, None, expected)
        engine.serving_dtype = None  # mixed dtypes here test the buckets; the dtype rule: test_publish_dtype.py
        engine.received = (version, tensors)
        return engine

    ok = engine_holding(7, passed)
    ok.verify(manifest.to_dict())
    assert ok.status["ok"] and ok.status["tensors"] == 4 and ok.staged.tensors == passed and ok.received is None

    corrupted = [(n, t.clone()) for n, t in passed]
    corrupted[3][1][0] = 9.0
    bad = engine_holding(7, corrupted)
    bad.verify(manifest.to_dict())
    assert not bad.status["ok"] and bad.status["bad_bucket"] == 2 and not bad.staged.ok

    stale = engine_holding(6, passed)  # announced 6, manifest says 7
    stale.verify(manifest.to_dict())
    assert not stale.status["ok"] and "announced 6" in stale.status["error"]

    partial_manifest, partial = _record(groups[:2])
    short = engine_holding(7, partial)
    short.verify(partial_manifest.to_dict())
    assert not short.status["ok"] and "missing 1" in short.status["error"]
    assert "model.norm.weight" in short.status["error"]

    garbled = engine_holding(7, passed)
    garbled.verify({"version": 7})
    assert not garbled.status["ok"] and "malformed" in garbled.status["error"]

    nothing = engine_holding(7, passed)
    nothing.received = None
    nothing.verify(manifest.to_dict())
    assert not nothing.status["ok"] and "before any publication" in nothing.status["error"]
