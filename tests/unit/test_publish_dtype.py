"""Dtype-true publication: the engine refuses tensors that are not in the dtype it serves (issue 18).

    python -m pytest tests/unit/test_publish_dtype.py -q

The trainer casts once to the engine's dtype (publish.trainer.engine_dtype, learner_group), the
checksums cover those bytes, and the manifest records every tensor's dtype.  A publication in
another dtype (e.g. fp32 into a bf16 engine) used to be loaded with a silent cast, so the bytes
verified were not the bytes served.  The receive-side check runs here without vLLM's engine:
VerifiedCommit is the staging/commit mixin both real backends use; its model_config is the only
thing it reads here (a namespace with the model dir and dtype).
"""

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.publish.manifest import PublicationManifest, pack_bucket, unpack_bucket
from megatron_rl.publish.wire import ReceivedPublication

pytestmark = pytest.mark.unit


def _engine(tmp_path, dtype):
    from megatron_rl.publish.vllm_engine import VerifiedCommit

    class Engine(VerifiedCommit):
        model_config = SimpleNamespace(model=str(tmp_path), dtype=dtype)  # no config.json: names unchecked
        model = None

    engine = Engine()
    engine._init_commit()
    return engine


def _publication(dtype):
    items = [("model.norm.weight", torch.ones(4, dtype=dtype)), ("lm_head.weight", torch.randn(3, 4).to(dtype))]
    spec, buf = pack_bucket(0, items, "blocksum")
    return ReceivedPublication(PublicationManifest(1, "blocksum", (spec,)), tensors=unpack_bucket(spec, buf))


def test_engine_refuses_a_publication_in_another_dtype(tmp_path):
    engine = _engine(tmp_path, torch.bfloat16)
    engine._stage(_publication(torch.float32), 1)
    assert engine.status["ok"] is False
    assert "model.norm.weight is float32" in engine.status["error"] and "bfloat16" in engine.status["error"]
    engine.finish_weight_update()  # nothing is loaded: the model keeps serving what it had
    assert engine.status["committed"] is False


def test_engine_stages_a_publication_in_its_dtype(tmp_path):
    engine = _engine(tmp_path, torch.bfloat16)
    engine._stage(_publication(torch.bfloat16), 1)
    assert engine.status["ok"] is True and engine.staged is not None


def test_manifest_records_dtypes():
    manifest = _publication(torch.bfloat16).manifest
    assert manifest.dtypes == ["bfloat16"]
    assert PublicationManifest.from_dict(manifest.to_dict()).dtype_problem("bfloat16") is None
    assert manifest.dtype_problem("float32").startswith("version 1: model.norm.weight is bfloat16")
