"""Publication manifest: bucket planning, packing, checksums, serialisation.

    python -m pytest tests/unit/test_publish_manifest.py -q
"""

import pytest
import torch

from megatron_rl.publish.checksum import checksum_parts
from megatron_rl.publish.manifest import (
    PublicationError,
    PublicationManifest,
    flatten_groups,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
    verify_tensors,
)

pytestmark = pytest.mark.unit


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(8, 4, generator=g)),  # 128 B
        ("model.layers.0.q.weight", torch.randn(4, 4, generator=g).to(torch.bfloat16)),  # 32 B
        ("model.layers.0.q.bias", torch.randn(4, generator=g)),  # 16 B
        ("model.norm.weight", torch.randn(300, generator=g)),  # 1200 B, bigger than a bucket
    ]


def test_plan_buckets_respects_size_and_order():
    buckets = list(plan_buckets(_tensors(), bucket_bytes=160))
    names = [[n for n, _ in b] for b in buckets]
    assert names == [
        ["model.embed_tokens.weight", "model.layers.0.q.weight"],
        ["model.layers.0.q.bias"],
        ["model.norm.weight"],
    ]
    with pytest.raises(ValueError, match="appears twice"):
        list(plan_buckets(_tensors() + _tensors()[:1], 160))
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(plan_buckets(_tensors(), 0))


def test_flatten_groups_accepts_pairs_and_groups():
    t = _tensors()
    assert [n for n, _ in flatten_groups([t[:2], t[2:]])] == [n for n, _ in t]
    assert [n for n, _ in flatten_groups(iter(t))] == [n for n, _ in t]


@pytest.mark.parametrize("algo", ["blocksum", "blake3"])
def test_pack_unpack_roundtrip_and_corruption(algo):
    items = _tensors()[:3]
    spec, buf = pack_bucket(0, items, algo)
    assert spec.nbytes == buf.numel() == 128 + 32 + 16
    manifest = PublicationManifest(version=0, checksum_algo=algo, buckets=(spec,))
    assert verify_tensors(manifest, unpack_bucket(spec, buf)) == (None, None)
    for (name, ref), (got_name, got) in zip(items, unpack_bucket(spec, buf)):
        assert name == got_name and got.dtype == ref.dtype and torch.equal(got, ref)
    buf[37] ^= 1
    problem, bad = verify_tensors(manifest, unpack_bucket(spec, buf))
    assert bad == 0 and "bucket 0" in problem and "model.embed_tokens.weight" in problem
    with pytest.raises(PublicationError, match="bucket 0"):
        unpack_bucket(spec, buf[:-1])


def test_manifest_roundtrip_and_validation():
    specs = tuple(pack_bucket(i, b, "blake3")[0] for i, b in enumerate(plan_buckets(_tensors(), 160)))
    m = PublicationManifest(version=7, checksum_algo="blake3", buckets=specs)
    assert PublicationManifest.from_dict(m.to_dict()) == m
    assert m.tensor_names == [n for n, _ in _tensors()]
    assert m.nbytes == sum(t.numel() * t.element_size() for _, t in _tensors())
    with pytest.raises(ValueError, match="checksum_algo 'md5'"):
        PublicationManifest(version=1, checksum_algo="md5", buckets=specs)
    with pytest.raises(ValueError, match="indices"):
        PublicationManifest(version=1, checksum_algo="blake3", buckets=specs[1:])
    with pytest.raises(ValueError, match="malformed"):
        PublicationManifest.from_dict({"version": 1})


def test_blocksum_detects_block_and_word_errors_and_ignores_alignment():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randint(0, 256, (5 * 4096 + 100,), dtype=torch.uint8, generator=g),
             torch.randint(0, 256, (3 * 4096,), dtype=torch.uint8, generator=g)]
    base = checksum_parts(parts, "blocksum")

    def changed(edit) -> bool:
        copy = [p.clone() for p in parts]
        edit(copy)
        return checksum_parts(copy, "blocksum") != base

    assert changed(lambda c: c[0].__setitem__(4097, int(c[0][4097]) ^ 0x10))  # one bit in a block
    assert changed(lambda c: c[0].__setitem__(-1, int(c[0][-1]) ^ 1))  # one bit in the tail
    assert changed(lambda c: c[1][:4096].copy_(c[1][4096:8192].clone()))  # a block holding another block's data
    assert changed(lambda c: c.reverse())  # tensors in the wrong order
    # Same bytes at an odd offset inside a larger buffer (a receiver's bucket): same digest.
    shifted = torch.empty(parts[0].numel() + 3, dtype=torch.uint8)
    shifted[3:] = parts[0]
    assert checksum_parts([shifted[3:], parts[1]], "blocksum") == base
    # The documented blind spot: two 8-byte words swapped inside one block.
    swapped = [p.clone() for p in parts]
    w = swapped[0][:4096].view(torch.int64)
    w[[0, 1]] = w[[1, 0]]
    assert checksum_parts(swapped, "blocksum") == base


def test_coverage_problem_names_missing_extra_and_misshapen_tensors():
    specs = tuple(pack_bucket(i, b, "blake3")[0] for i, b in enumerate(plan_buckets(_tensors(), 160)))
    m = PublicationManifest(version=4, checksum_algo="blake3", buckets=specs)
    expected = {n: tuple(t.shape) for n, t in _tensors()}
    assert m.coverage_problem(expected) is None
    first = next(iter(expected))
    assert "missing 1" in m.coverage_problem({**expected, "lm_head.weight": (8, 4)})
    assert "lm_head.weight" in m.coverage_problem({**expected, "lm_head.weight": (8, 4)})
    fewer = {k: v for k, v in expected.items() if k != first}
    assert f"does not have, e.g. {first!r}" in m.coverage_problem(fewer)
    assert f"{first} has shape" in m.coverage_problem({**expected, first: (1, 2, 3)})
