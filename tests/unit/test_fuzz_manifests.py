"""Fuzz (hypothesis) of the two manifests read from outside: publication and checkpoint.

    python -m pytest tests/unit/test_fuzz_manifests.py -q

Publication: `PublicationManifest.from_dict` takes plain data from the wire (gloo END message)
or an RPC (vLLM's NCCL path).  Arbitrary JSON, damaged JSON text of a real manifest and
valid manifests with one field replaced must give a manifest or ManifestError (a ValueError);
a manifest that parses can unpack a buffer of its announced size (no view error later).

Checkpoint: the COMMITTED manifest of a real checkpoint is damaged on disk; read_manifest,
load_checkpoint, checkpoint_status and resume_checkpoint must raise CheckpointError (or
report the checkpoint corrupt / skip it), never another exception, and never read a file
outside the checkpoint.
"""

import json
import shutil

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron_rl import checkpoint as ck
from megatron_rl.publish.manifest import ManifestError, PublicationManifest, pack_bucket, unpack_bucket
from tests.unit.fuzz_common import FUZZ, JSON_VALUES, mutate

pytestmark = pytest.mark.unit


def real_manifest() -> dict:
    t = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b.bias": torch.ones(4, dtype=torch.bfloat16),
         "c": torch.zeros(1, dtype=torch.int64)}
    b0, _ = pack_bucket(0, list(t.items())[:2], "blake3")
    b1, _ = pack_bucket(1, list(t.items())[2:], "blake3")
    return PublicationManifest(7, "blake3", (b0, b1)).to_dict()


def check_publication(data) -> None:
    try:
        manifest = PublicationManifest.from_dict(data)
    except ManifestError as err:
        assert str(err).startswith("malformed publication manifest")
        return
    for spec in manifest.buckets:
        if spec.nbytes <= 1 << 16:
            unpack_bucket(spec, torch.zeros(spec.nbytes, dtype=torch.uint8))
    assert PublicationManifest.from_dict(manifest.to_dict()) == manifest


@FUZZ
@given(JSON_VALUES)
def test_publication_arbitrary_json(data):
    check_publication(data)


@FUZZ
@given(st.data())
def test_publication_damaged_json_text(data):
    text = json.dumps(real_manifest()).encode()
    try:
        parsed = json.loads(mutate(text, data))
    except ValueError:
        return  # not JSON: the receiver's header parser already reports that
    check_publication(parsed)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


@FUZZ
@given(st.data())
def test_publication_one_field_replaced(data):
    manifest = real_manifest()
    path = data.draw(st.sampled_from([p for p in _paths(manifest) if p]))
    node = manifest
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = data.draw(JSON_VALUES)
    check_publication(manifest)


@pytest.mark.parametrize("change, field", [
    (lambda m: m.update(version=float("inf")), "version"),  # int(inf) raised OverflowError
    (lambda m: m["buckets"][0]["tensors"][0].__setitem__(1, [2, 4]), "a.weight"),  # view error at unpack
    (lambda m: m["buckets"][0]["tensors"][1].__setitem__(3, 0), "b.bias"),  # overlapping tensors
    (lambda m: m["buckets"][1]["tensors"][0].__setitem__(2, "float99"), "unknown dtype"),
    (lambda m: m["buckets"][1].update(nbytes=2**40), "nbytes"),  # a receiver would allocate 1 TiB
    (lambda m: m["buckets"][1]["tensors"][0].__setitem__(0, "a.weight"), "twice"),
])
def test_publication_regressions(change, field):
    manifest = real_manifest()
    change(manifest)
    with pytest.raises(ManifestError, match=field):
        PublicationManifest.from_dict(manifest)


# ------------------------------------------------------------------ checkpoint manifest


@pytest.fixture(scope="module")
def ckpt_template(tmp_path_factory):
    run = tmp_path_factory.mktemp("ckpt_template")

    def save(d):
        (d / "weights").mkdir()
        (d / "weights" / "w.bin").write_bytes(b"\x01" * 100)

    path = ck.save_checkpoint(run, 3, policy_version=3, config_hash="c" * 64, save_fn=save, tokenizer_hash="t" * 64,
                              data_cursor={"epoch": 0}, coordinator_log_position=5,
                              rng_states={0: {"python": 1}})
    (run / "outside.txt").write_text("a file outside the checkpoint")
    return path


def check_checkpoint(template, work, blob: bytes) -> None:
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(template.parent, run)
    step = run / template.name
    (step / ck.MANIFEST).write_bytes(blob)
    ck._VERIFIED.clear()
    (row,) = ck.checkpoint_status(run)
    if row["status"] == "corrupt":
        assert row["problem"]
        with pytest.raises(ck.CheckpointError, match="no intact checkpoint"):
            ck.resume_checkpoint(run)
        with pytest.raises(ck.CheckpointError):
            ck.load_checkpoint(step)
        return
    assert row["status"] == "intact", row
    assert ck.resume_checkpoint(run) == step
    try:
        manifest = ck.load_checkpoint(step, tokenizer_hash="t" * 64)
    except ck.CheckpointError as err:
        assert "tokenizer" in str(err)
        manifest = ck.read_manifest(step)
    assert all(not rel.startswith("..") and not rel.startswith("/") for rel in manifest["files"])
    for r in manifest["rng"]["ranks"]:
        try:
            ck.load_rng_state(step, r)
        except ck.CheckpointError:
            pass


@FUZZ
@given(st.data())
def test_checkpoint_manifest_damaged_bytes(ckpt_template, tmp_path_factory, data):
    blob = (ckpt_template / ck.MANIFEST).read_bytes()
    for _ in range(data.draw(st.integers(1, 3))):
        blob = mutate(blob, data)
    check_checkpoint(ckpt_template, tmp_path_factory.getbasetemp() / "ckpt_fuzz", blob)


@FUZZ
@given(st.data())
def test_checkpoint_manifest_one_field_replaced(ckpt_template, tmp_path_factory, data):
    manifest = json.loads((ckpt_template / ck.MANIFEST).read_text())
    path = data.draw(st.sampled_from([p for p in _paths(manifest) if p]))
    node = manifest
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = data.draw(JSON_VALUES)
    check_checkpoint(ckpt_template, tmp_path_factory.getbasetemp() / "ckpt_fuzz", json.dumps(manifest).encode())


@pytest.mark.parametrize("change, problem", [
    (lambda m: m.update(files=[]), "files"),  # AttributeError in verify_files
    (lambda m: m["files"].update({"w": {"sha256": "0" * 64}}), "files"),  # KeyError 'bytes'
    (lambda m: m["files"].update({"../outside.txt": {"sha256": "0" * 64, "bytes": 29}}), "relative path"),
    (lambda m: m.update(rng={"ranks": "0"}), "rng"),  # iterated as characters by the resume
    (lambda m: m.update(step="3"), "step"),
])
def test_checkpoint_regressions(ckpt_template, tmp_path, change, problem):
    manifest = json.loads((ckpt_template / ck.MANIFEST).read_text())
    change(manifest)
    run = tmp_path / "run"
    shutil.copytree(ckpt_template.parent, run)
    (run / ckpt_template.name / ck.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ck.CheckpointError, match=problem):
        ck.read_manifest(run / ckpt_template.name)


def test_checkpoint_deeply_nested_manifest_is_a_checkpoint_error(ckpt_template, tmp_path):
    step = tmp_path / "step_000001"
    step.mkdir()
    (step / ck.MANIFEST).write_text("[" * 100_000 + "]" * 100_000)  # json.loads raised RecursionError
    with pytest.raises(ck.CheckpointError, match="unreadable"):
        ck.read_manifest(step)
