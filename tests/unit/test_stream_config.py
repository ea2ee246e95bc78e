"""Streaming rollouts' settings (rollout.streaming, rollout.inflight_refit): bad values are refused up front,
naming the key, and a streaming run's batch and provenance bookkeeping hold (issue 27)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.sample import RolloutSample
from megatron_rl.rollout.stream_engine import REFIT_MODES
from megatron_rl.train.config import load_train_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_scratch.yaml"


def test_every_documented_refit_mode_is_one_the_engine_knows():
    for mode in ("wait", "recompute", "keep_kv"):
        assert RolloutConfig(streaming=True, inflight_refit=mode).inflight_refit in REFIT_MODES


@pytest.mark.parametrize("bad, words", [
    ({"inflight_refit": "abort"}, "rollout.inflight_refit 'abort' is not one of"),
    ({"streaming": "yes"}, "rollout.streaming must be true or false"),
    ({"streaming": True, "sleep_mode": True}, "a streaming engine never sleeps"),
])
def test_bad_streaming_settings_are_refused_by_name(bad, words):
    with pytest.raises(ValueError, match=words):
        RolloutConfig(**bad)


def test_streaming_with_dynamic_sampling_is_refused_by_the_training_config(tmp_path):
    with pytest.raises(ConfigError, match="dynamic_sampling needs rollout rounds"):
        load_train_config(TINY, [f"run.dir={tmp_path}", "rollout.streaming=true", "dynamic_sampling.enabled=true"])
    cfg = load_train_config(TINY, [f"run.dir={tmp_path}", "rollout.streaming=true", "rollout.inflight_refit=keep_kv"])
    assert cfg.rollout.streaming and cfg.rollout.inflight_refit == "keep_kv"


def _sample(versions: list[int]) -> RolloutSample:
    return RolloutSample(prompt_tokens=[1, 2], response_tokens=list(range(len(versions))),
                         behavior_logprobs=[-1.0] * len(versions), policy_versions=versions, sampling={},
                         finish_reason="length", started_at=0.0, finished_at=1.0, extra={})


def test_a_batch_is_the_first_groups_that_finish_and_counts_its_version_switches():
    """StreamProducer.next over finished groups (no engine: the groups are handed in as finished)."""
    import threading

    from megatron_rl.train.stream_producer import StreamProducer

    class Admission:  # the coordinator's admission, as the producer sees it
        config = type("C", (), {"lease_ttl_s": 60.0, "batch_size": 4})()
        lookahead = 1

    producer = StreamProducer(Admission(), prepare_group=None, grade=None, steps=2, groups_per_step=2, group_size=2,
                              max_groups_in_flight=4)
    producer._thread = threading.current_thread()  # "running": next() waits for groups rather than refusing
    for serial, versions in ((7, [0, 0, 1]), (3, [1, 1, 1]), (5, [0, 1, 2])):
        producer._groups.append((serial, [_sample(versions), _sample(versions)], [f"l{serial}a", f"l{serial}b"], 1.0))
    rnd = producer.next(0)
    assert [s.policy_versions for s in rnd.samples] == [[0, 0, 1]] * 2 + [[1, 1, 1]] * 2  # completion order
    assert rnd.leases == ["l7a", "l7b", "l3a", "l3b"]
    assert rnd.stats["system/stream_segments_per_sample"] == pytest.approx(1.5)
    assert rnd.stats["system/stream_multi_version_fraction"] == pytest.approx(0.5)
    assert [g[0] for g in producer._groups] == [5]  # the third group waits for the next batch
