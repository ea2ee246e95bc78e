"""RolloutWorker actors (TP=1 and TP=2) generate and receive checked weight publications.

    python -m pytest tests/e2e/test_rollout.py -q

One Ray cluster and two real vLLM engines (a TP=1 and a TP=2 rollout group) per module.
The test process plays the trainer: it publishes the tiny model's own tensors, modified,
and checks vLLM's teacher-forced logprobs against transformers with the same weights.
"""

import math
import os

import pytest
import torch

from megatron_rl.models.tiny import make_tiny_model
from megatron_rl.models.tokenizer import BOS_ID
from megatron_rl.publish import WeightPublisher
from megatron_rl.rollout import RolloutConfig, create_rollout_worker
from tests.e2e.conftest import rollout_cluster
from tests.reference import SEQUENCES, hf_logprobs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("rollout") / "qwen2", arch="qwen2", seed=2)
    with rollout_cluster() as workers:
        # 32-token KV blocks, so a 48-token prompt leaves a full block in vLLM's prefix cache.
        common = dict(model=str(model), max_model_len=128, dtype="float32", max_tokens=8,
                      engine_options={"block_size": 32})
        workers.extend(create_rollout_worker(RolloutConfig(tensor_parallel_size=tp, **common)) for tp in (1, 2))
        publisher = WeightPublisher(bucket_bytes=256 * 1024)
        publisher.connect(workers)
        yield model, workers, publisher


def _scores(workers):
    import ray

    rows = ray.get([w.score.remote(SEQUENCES) for w in workers])
    return [[torch.tensor(s[1:], dtype=torch.float64) for s in r] for r in rows]


def test_generate_sample_fields(cluster):
    import ray

    from megatron_rl.rollout.sample import PromptInfo

    _, workers, _ = cluster
    prompts = [[BOS_ID, 23, 24], [BOS_ID, 40, 41, 42], [BOS_ID]]
    for w in workers:
        version = ray.get(w.policy_version.remote())
        label = ray.get(w.__ray_call__.remote(lambda self: self.label))  # "<version>:<digest>" (provenance)
        info = [PromptInfo(id=str(i)) for i in range(3)]
        samples = ray.get(w.generate.remote(prompts, {"seed": 11, "max_tokens": 6}, 2, info))
        assert len(samples) == 6
        for k, s in enumerate(samples):
            s.check()
            # The engine's own label for the weights behind every token (rollout/provenance.py).
            assert s.prompt_tokens == prompts[k // 2] and s.prompt == info[k // 2]
            assert s.weights == {str(version): label.split(":")[1]} and s.segments == [] and s.episode is None
            assert 1 <= len(s.response_tokens) <= 6
            assert len(s.behavior_logprobs) == len(s.response_tokens) == len(s.policy_versions)
            assert all(math.isfinite(x) and x <= 0 for x in s.behavior_logprobs)
            assert s.policy_versions == [version] * len(s.response_tokens)
            assert s.finish_reason == ("length" if len(s.response_tokens) == 6 else "stop")
            assert s.sampling["seed"] == 11 + k // 2 and s.sampling["max_tokens"] == 6
            assert s.seconds >= 0
        again = ray.get(w.generate.remote(prompts, {"seed": 11, "max_tokens": 6}, 2))
        assert [s.response_tokens for s in again] == [s.response_tokens for s in samples]
    with pytest.raises(ray.exceptions.RayTaskError, match="unknown sampling key 'temp'"):
        ray.get(workers[0].generate.remote(prompts, {"temp": 1.0}))
    # Ray starts workers at nice 15; engines must not inherit it (platform/priority.py).
    for w in workers:
        assert ray.get(w.__ray_call__.remote(lambda self: os.getpriority(os.PRIO_PROCESS, 0))) == 0


def test_the_round_engine_plays_episodes(cluster):
    """Issue 45 item 5: multi-turn on the round engine (RolloutWorker.run_episodes, rollout/turn_batcher.py),
    on both groups: guess_number episodes with the streaming engine's sample contract, and seeded."""
    import ray

    from megatron_rl.envs.example import Example
    from megatron_rl.envs.protocol import TERMINAL_REASONS

    _, workers, _ = cluster
    env = {"name": "guess_number", "options": {"low": 1, "high": 8, "max_guesses": 3}, "chat_template": "plain",
           "system_prompt": "", "max_turns": 3, "max_total_tokens": 120}
    examples = [Example(id=f"e{a}", question="", answer=str(a)) for a in (3, 5)]
    for w in workers:
        version = ray.get(w.policy_version.remote())
        digest = ray.get(w.__ray_call__.remote(lambda self: self.label)).split(":")[1]
        samples = ray.get(w.run_episodes.remote(examples, {"seed": 7, "max_tokens": 6}, 2, None, env=env))
        again = ray.get(w.run_episodes.remote(examples, {"seed": 7, "max_tokens": 6}, 2, None, env=env))
        assert len(samples) == 4 and [s.response_tokens for s in again] == [s.response_tokens for s in samples]
        assert max(s.episode.turns for s in samples) > 1, "no episode had a second turn"
        for s in samples:
            s.check()
            assert s.episode.env == "guess_number" and s.episode.terminal_reason in TERMINAL_REASONS
            assert s.weights == {str(version): digest} and set(s.policy_versions) == {version}
            assert sum(e - b for b, e, *_ in s.segments) == len(s.response_tokens)
            assert s.action_mask[0] == 1 and s.action_mask[-1] == 1
            lps = [lp for lp, m in zip(s.behavior_logprobs, s.action_mask) if m == 0]
            assert set(lps) <= {0.0} and all(lp <= 0 for lp in s.behavior_logprobs)


def test_publication_matches_transformers_and_bad_bucket_is_refused(cluster):
    import ray
    from safetensors.torch import load_file

    model_dir, workers, publisher = cluster
    base = load_file(model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    long_prompt = [BOS_ID] + [23 + i % 60 for i in range(47)]
    ray.get([w.generate.remote([long_prompt], {"seed": 3, "max_tokens": 1}) for w in workers])  # cached, old weights
    # One group per layer, as a Megatron source gathering TP shards would yield them.
    layers = sorted({k.split(".")[2] for k in new if k.startswith("model.layers.")})
    groups = [[(k, v) for k, v in new.items() if not k.startswith("model.layers.")]]
    groups += [[(k, v) for k, v in new.items() if k.startswith(f"model.layers.{i}.")] for i in layers]

    report = publisher.publish(1, groups)
    assert report.committed, report.results
    assert len(report.manifest.buckets) > 2
    assert [r["version"] for r in report.results] == [1, 1]
    assert len(report.results[1]["workers"]) == 2  # both TP ranks of the TP=2 group verified
    ref = hf_logprobs(model_dir, new)
    for got_rows in _scores(workers):
        for got, want in zip(got_rows, ref):
            assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    # Nothing generated after the switch uses old weights, cached prompt KV included.
    for w in workers:
        (sample,) = ray.get(w.generate.remote([long_prompt], {"seed": 3, "max_tokens": 1}))
        assert sample.policy_versions == [1]
        (scored,) = ray.get(w.score.remote([long_prompt + sample.response_tokens]))  # prompt logprobs: no cache
        assert abs(sample.behavior_logprobs[0] - scored[-1]) < 1e-4, (sample.behavior_logprobs[0], scored[-1])

    def corrupt(spec, buf):
        if spec.index == 1:
            buf[buf.numel() // 2] ^= 0x10

    bad = publisher.publish(2, list(base.items()), fault_hook=corrupt)
    assert not bad.committed
    for r in bad.results:
        assert r["version"] == 1 and r["bad_bucket"] == 1 and "bucket 1" in r["error"]
    for got_rows in _scores(workers):  # still serving version 1
        for got, want in zip(got_rows, ref):
            assert torch.allclose(got, want, atol=1e-4)
    partial = [(k, v) for k, v in base.items() if k != "model.layers.1.mlp.down_proj.weight"]
    incomplete = publisher.publish(3, partial)
    assert not incomplete.committed
    for r in incomplete.results:
        assert r["version"] == 1 and "missing 1" in r["error"] and "model.layers.1.mlp.down_proj.weight" in r["error"]
    sample = ray.get(workers[1].generate.remote([SEQUENCES[0]], {"seed": 1, "max_tokens": 3}))[0]
    assert sample.policy_versions == [1] * len(sample.response_tokens)


def test_failed_load_on_one_tp_rank_rolls_the_whole_group_back(cluster):
    """Worker 1 of the TP=2 group fails half-way through loading: both workers reload the
    version they served (a host copy), the version stamp stays, and the next publication loads."""
    import ray
    from safetensors.torch import load_file

    model_dir, workers, publisher = cluster
    tp2 = workers[1]
    version = ray.get(tp2.policy_version.remote())
    before_scores, before_sums = _scores([tp2])[0], ray.get(tp2.weight_checksums.remote())
    base = load_file(model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    new = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()}

    ray.get(tp2.fail_next_load.remote(3, 1))
    report = publisher.publish(version + 10, list(new.items()))
    assert not report.committed
    tp1_result, tp2_result = report.results
    assert tp1_result["committed"] and tp1_result["version"] == version + 10  # the other group is unaffected
    assert not tp2_result["committed"] and tp2_result["version"] == version
    assert "load_weights failed" in tp2_result["error"] and "injected load failure" in tp2_result["error"]
    assert ray.get(tp2.weight_checksums.remote()) == before_sums  # both TP ranks back to the old weights
    for got, want in zip(_scores([tp2])[0], before_scores):
        assert torch.allclose(got, want, atol=1e-6)
    (sample,) = ray.get(tp2.generate.remote([SEQUENCES[0]], {"seed": 1, "max_tokens": 3}))
    assert sample.policy_versions == [version] * len(sample.response_tokens)

    again = publisher.publish(version + 11, list(new.items()))  # nothing left half-done
    assert again.committed, again.results
    ref = hf_logprobs(model_dir, new)
    for got_rows in _scores(workers):
        for got, want in zip(got_rows, ref):
            assert torch.allclose(got, want, atol=1e-4)


def test_publication_is_refused_when_the_prefix_cache_cannot_be_reset(cluster):
    import ray
    from safetensors.torch import load_file

    model_dir, workers, publisher = cluster
    tp1 = workers[0]
    version = ray.get(tp1.policy_version.remote())
    before = ray.get(tp1.weight_checksums.remote())
    # Test double for vLLM refusing the reset (it does while requests are running).
    ray.get(tp1.__ray_call__.remote(lambda self: setattr(self.llm, "reset_prefix_cache", lambda: False)))
    try:
        report = publisher.publish(version + 1, list(load_file(model_dir / "model.safetensors").items()))
    finally:
        ray.get(tp1.__ray_call__.remote(lambda self: delattr(self.llm, "reset_prefix_cache")))
    result = report.results[0]
    assert not result["committed"] and result["version"] == version and "prefix cache" in result["error"]
    assert ray.get(tp1.weight_checksums.remote()) == before  # the old weights still serve
