"""A LoRA run's rollout engine: each published version is an adapter, installed from memory, checked.

    python -m pytest tests/e2e/test_lora_rollout.py -q

A real vLLM engine at tensor parallel size 2 with LoRA on (rollout.adapter, as a LoRA run sets it) -- the
offline engine of round-based runs, then the streaming one (rollout.streaming) -- a Ray cluster, and the
test process as the trainer publishing PEFT-named adapters through the gloo path.
Checked against transformers with each adapter merged into the weights (conversion/lora_export.py): the
engine scores under the newest adapter, an older kept version still scores as itself (a request keeps
its adapter), and bad publications -- a corrupt bucket, a missing or misshapen tensor, full weights, an
adapter whose refit check fails -- are refused while every kept adapter stays as it was.  On the streaming
engine a publication lands while requests generate: each keeps the adapter it started with to its end.
One Ray cluster, model and set of transformers references for both engines (`_rig`); the streaming engine
starts loading with the offline one, and the offline one ends before the streaming tests run.
"""

import pytest
import torch

from megatron_rl.conversion.lora_export import merge_into_hf
from megatron_rl.models.hf_config import load_hf_config
from megatron_rl.models.lora import LoraConfig
from megatron_rl.models.tiny import make_tiny_model
from megatron_rl.publish import WeightPublisher
from megatron_rl.publish.adapter_source import adapter_shapes
from megatron_rl.rollout import RolloutConfig, create_rollout_worker
from megatron_rl.rollout.stream_actor import create_stream_worker
from tests.e2e.conftest import rollout_cluster
from tests.reference import SEQUENCES, hf_logprobs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LORA = LoraConfig(enabled=True, rank=8, alpha=16.0)


KINDS = ("offline", "stream")


@pytest.fixture(scope="module")
def _rig(tmp_path_factory):
    """The module's one Ray cluster, tiny model and reference logprobs (`_versions`), and both engines,
    created at once: the streaming one loads while the offline one's tests run."""
    model = make_tiny_model(tmp_path_factory.mktemp("lora") / "qwen2", arch="qwen2", seed=2)
    with rollout_cluster() as workers:
        for kind in KINDS:
            cfg = RolloutConfig(model=str(model), tensor_parallel_size=2, max_model_len=256, dtype="float32",
                                max_tokens=8, adapter=LORA.serving(2), streaming=kind == "stream")
            workers.append(create_stream_worker(cfg) if cfg.streaming else create_rollout_worker(cfg))
        yield model, dict(zip(KINDS, workers)), _versions(model)


@pytest.fixture(scope="module", params=KINDS)
def engine(request, _rig):
    """One engine (its own publisher, the test process as the trainer); ended with its param's tests."""
    import ray

    model, workers, versions = _rig
    worker = workers[request.param]
    publisher = WeightPublisher(bucket_bytes=64 * 1024)
    publisher.connect([worker])
    yield model, worker, publisher, versions, request.param
    ray.get(worker.shutdown.remote(), timeout=60)  # (again at the cluster's end: a no-op then)


def _versions(model):
    """Two random adapters (PEFT names) and, for each, transformers' logprobs with it merged in."""
    from safetensors.torch import load_file

    base = load_file(model / "model.safetensors")
    shapes = adapter_shapes(LORA, load_hf_config(model))
    out = {0: (None, hf_logprobs(model, base))}
    for version in (1, 2):
        g = torch.Generator().manual_seed(version)
        adapter = {n: 0.15 * torch.randn(shape, generator=g) for n, shape in sorted(shapes.items())}
        merged = {n: merge_into_hf(n, w, adapter, LORA) for n, w in base.items()}
        out[version] = (adapter, hf_logprobs(model, merged))
    return out


def _scores(worker, version=None):
    import ray

    rows = ray.get(worker.score.remote(SEQUENCES, version))
    return [torch.tensor(r[1:], dtype=torch.float64) for r in rows]


def _assert_scores(worker, want, version=None):
    for got, ref in zip(_scores(worker, version), want):
        assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_each_version_is_its_adapter_and_a_kept_one_still_serves(engine):
    import ray

    model, worker, publisher, versions, _ = engine
    _assert_scores(worker, versions[0][1])  # version 0: the base, no adapter yet
    for version in (1, 2):
        adapter, want = versions[version]
        report = publisher.publish(version, list(adapter.items()))
        assert report.committed, report.results
        assert len(report.results[0]["workers"]) == 2  # both TP ranks verified and installed it
        _assert_scores(worker, want)
        # Adapter-only: the publication is a small part of the model's bytes.
        assert report.manifest.nbytes < 0.5 * (model / "model.safetensors").stat().st_size
    assert max(float((a - b).abs().max()) for a, b in zip(versions[2][1], versions[0][1])) > 0.05  # not the base
    _assert_scores(worker, versions[1][1], version=1)  # version 1 is still kept: its requests finish under it
    (sample,) = ray.get(worker.generate.remote([SEQUENCES[0]], {"seed": 1, "max_tokens": 3}))
    assert sample.policy_versions == [2] * len(sample.response_tokens)
    (scored,) = ray.get(worker.score.remote([SEQUENCES[0] + sample.response_tokens]))
    assert abs(sample.behavior_logprobs[-1] - scored[-1]) < 1e-4  # sampled under version 2's adapter


def test_bad_adapter_publications_are_refused_and_kept_adapters_stay(engine):
    import ray
    from safetensors.torch import load_file

    model, worker, publisher, versions, _ = engine
    adapter = versions[2][0]

    def corrupt(spec, buf):
        if spec.index == 0:
            buf[buf.numel() // 2] ^= 0x10

    bad = publisher.publish(3, list(adapter.items()), fault_hook=corrupt)
    assert not bad.committed and "bucket 0" in bad.results[0]["error"]
    name = sorted(adapter)[0]
    missing = publisher.publish(4, [(n, t) for n, t in adapter.items() if n != name])
    assert not missing.committed and "missing 1" in missing.results[0]["error"] and name in missing.results[0]["error"]
    wrong_rank = publisher.publish(5, [(n, t[:4] if n.endswith("lora_A.weight") else t[:, :4])
                                       for n, t in adapter.items()])
    assert not wrong_rank.committed and "has shape" in wrong_rank.results[0]["error"]
    full = publisher.publish(6, list(load_file(model / "model.safetensors").items()))
    assert not full.committed and "missing" in full.results[0]["error"]
    # Bytes that verify but compute something else than the learner: the refit check refuses them, and only
    # the new adapter goes; the kept ones stay.
    wrong = [[lp - 1.0 for lp in row] for row in versions[1][1]]
    ray.get(worker.expect_probe.remote(7, SEQUENCES, wrong, 1e-3))
    refused = publisher.publish(7, list(versions[1][0].items()))
    assert not refused.committed and "refit check" in refused.results[0]["error"]
    assert ray.get(worker.policy_version.remote()) == 2
    _assert_scores(worker, versions[2][1])
    _assert_scores(worker, versions[1][1], version=1)


def test_a_streaming_request_keeps_its_adapter_across_a_publication(engine):
    import time

    import ray

    model, worker, publisher, versions, kind = engine
    if kind != "stream":
        pytest.skip("the offline engine runs one call at a time: no publication lands while it generates")
    assert ray.get(worker.policy_version.remote()) == 2  # the tests above published 1 and 2
    long = {"max_tokens": 200, "ignore_eos": True}
    refs = [worker.generate.remote([SEQUENCES[k % 2]], {"seed": k, **long}) for k in range(8)]
    deadline = time.monotonic() + 60
    while ray.get(worker.in_flight.remote()) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    report = publisher.publish(8, list(versions[1][0].items()))  # version 8: adapter 1's tensors
    committed_at = time.time()
    assert report.committed, report.results
    samples = [s for ref in refs for s in ray.get(ref)]
    assert any(s.finished_at > committed_at for s in samples)  # some were generating across the commit
    for s in samples:  # ... and kept version 2's adapter to their end: its tokens, its logprobs
        assert s.policy_versions == [2] * 200 and s.segments == [[0, 200, 2, 2]], s.segments
        (scored,) = ray.get(worker.score.remote([s.prompt_tokens + s.response_tokens], 2))
        got = torch.tensor(s.behavior_logprobs, dtype=torch.float64)
        assert torch.allclose(got, torch.tensor(scored[len(s.prompt_tokens):], dtype=torch.float64), atol=1e-4)
    (after,) = ray.get(worker.generate.remote([SEQUENCES[0]], {"seed": 9, "max_tokens": 3}))
    assert after.policy_versions == [8] * 3
    _assert_scores(worker, versions[1][1])  # the committed version's adapter serves new requests
