"""Streaming rollouts' settings (rollout.streaming, rollout.inflight_refit): bad values are refused up front,
naming the key, and a streaming run's batch and provenance bookkeeping hold (issue 27)."""

from __future__ import annotations

import time
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


def test_streaming_composes_with_dynamic_sampling_in_the_training_config(tmp_path):
    cfg = load_train_config(TINY, [f"run.dir={tmp_path}", "rollout.streaming=true", "dynamic_sampling.enabled=true"])
    assert cfg.rollout.streaming and cfg.dynamic_sampling.enabled  # filtered group by group (stream_producer.py)
    cfg = load_train_config(TINY, [f"run.dir={tmp_path}", "rollout.streaming=true", "rollout.inflight_refit=keep_kv"])
    assert cfg.rollout.streaming and cfg.rollout.inflight_refit == "keep_kv"


def _sample(versions: list[int]) -> RolloutSample:
    return RolloutSample(prompt_tokens=[1, 2], response_tokens=list(range(len(versions))),
                         behavior_logprobs=[-1.0] * len(versions), policy_versions=versions, sampling={},
                         finish_reason="length", started_at=0.0, finished_at=1.0)


def test_a_batch_is_the_first_groups_that_finish_and_counts_its_version_switches():
    """StreamProducer.next over finished groups (no engine: the groups are handed in as finished): the first two
    that finished, learned in serial order (the order they finished in is timing; the sums of a batch taken in
    it differ in their last bits from run to run)."""
    import threading

    from megatron_rl.sampling.stream_producer import StreamProducer

    class Admission:  # the coordinator's admission, as the producer sees it
        config = type("C", (), {"lease_ttl_s": 60.0, "batch_size": 4})()
        lookahead = 1

    producer = StreamProducer(Admission(), prepare_group=None, grade=None, steps=2, groups_per_step=2, group_size=2,
                              max_groups_in_flight=4)
    producer.loop.thread = threading.current_thread()  # "running": next() waits for groups rather than refusing
    for serial, versions in ((7, [0, 0, 1]), (3, [1, 1, 1]), (5, [0, 1, 2])):
        producer._groups.append((serial, [_sample(versions), _sample(versions)], [f"l{serial}a", f"l{serial}b"], 1.0))
    rnd = producer.next(0)
    assert [s.policy_versions for s in rnd.samples] == [[1, 1, 1]] * 2 + [[0, 0, 1]] * 2  # serials 3, 7
    assert rnd.leases == ["l3a", "l3b", "l7a", "l7b"]
    assert rnd.stats["system/stream_segments_per_sample"] == pytest.approx(1.5)
    assert rnd.stats["system/stream_multi_version_fraction"] == pytest.approx(0.5)
    assert [g[0] for g in producer._groups] == [5]  # the third group waits for the next batch


def test_a_group_that_would_fall_out_of_the_version_window_goes_into_this_batch():
    """Shorter groups keep finishing first; a long group admitted at version 0 would be out of the take window
    (versions [v - 1, v]) after batch 1, so batch 1 waits for it and takes it first (starved, it was dropped)."""
    import threading

    from megatron_rl.sampling.stream_producer import StreamProducer

    class Admission:
        config = type("C", (), {"lease_ttl_s": 60.0, "batch_size": 2})()
        lookahead = 1

    producer = StreamProducer(Admission(), prepare_group=None, grade=None, steps=3, groups_per_step=1, group_size=2,
                              max_groups_in_flight=4)
    producer.loop.thread = threading.current_thread()
    producer._in_flight, producer._floor = {0: None}, {0: 0}  # the long group 0, admitted when version 0 served
    for serial in (1, 2, 3):
        producer._groups.append((serial, [_sample([1]), _sample([1])], [f"l{serial}a", f"l{serial}b"], 1.0))
    assert producer.next(0).leases == ["l1a", "l1b"]  # batch 0 may still leave group 0 for batch 1
    got: list = []
    taker = threading.Thread(target=lambda: got.append(producer.next(1)))
    taker.start()
    taker.join(0.3)
    assert taker.is_alive(), "batch 1 went ahead without the group that cannot wait for batch 2"
    with producer.loop.cond:
        producer._groups.append((0, [_sample([0, 1]), _sample([0, 1])], ["l0a", "l0b"], 9.0))
        producer._in_flight.pop(0)
        producer.loop.cond.notify_all()
    taker.join(10)
    assert got[0].leases == ["l0a", "l0b"] and [g[0] for g in producer._groups] == [2, 3]
    # the learner's wait is counted as the window's (enough groups had finished): 0.3 s at least, none as short
    assert got[0].stats["system/stream_wait_window_s"] >= 0.3 and "system/stream_wait_groups_s" not in got[0].stats
    producer._groups.append((4, [_sample([0]), _sample([0])], ["l4a", "l4b"], 1.0))  # finished last, oldest
    assert producer.next(2).leases == ["l4a", "l4b"]  # out of the window next: before groups 2 and 3


def test_a_group_admitted_after_a_publication_is_as_young_as_it_before_the_next_batch_is_asked_for():
    """The driver announces version 1 (coordinator.set_version), admission opens and a group is submitted before
    the driver asks for batch 1: its tokens will carry version 1 or later, so batch 1 (window [0, 1]) need not
    wait for it -- batch 2 can still take it.  Counted as version 0, batch 1 waited for it (the long tail's
    wait, measured)."""
    import threading

    from megatron_rl.sampling.stream_producer import StreamProducer

    class Pool:  # test double of the producer's thread pool: the group stays "generating"
        def submit(self, *args):
            pass

    admission = _Admission()
    admission.lookahead = 1
    producer = StreamProducer(admission, prepare_group=None, grade=None, steps=3, groups_per_step=1, group_size=2,
                              max_groups_in_flight=4)
    producer.loop.thread, producer._pool = threading.current_thread(), Pool()
    producer._groups.append((0, [_sample([0]), _sample([0])], ["l0a", "l0b"], 1.0))
    assert producer.next(0).leases == ["l0a", "l0b"]
    admission.published = 1  # the driver published version 1; admission opened; batch 1 not asked for yet
    producer._submit(2, [2], ["l2a", "l2b"], generate=None)
    assert producer._floor[2] == 1
    producer._groups.append((1, [_sample([0, 1]), _sample([0, 1])], ["l1a", "l1b"], 1.0))
    got: list = []
    taker = threading.Thread(target=lambda: got.append(producer.next(1)))
    taker.start()
    taker.join(3)
    if taker.is_alive():  # release it before failing
        with producer.loop.cond:
            producer._in_flight.pop(2)
            producer.loop.cond.notify_all()
        taker.join(10)
    assert got[0].leases == ["l1a", "l1b"] and "system/stream_wait_window_s" not in got[0].stats


def _traj(versions: list[int], segments: list) -> "Trajectory":
    from megatron_rl.trajectory import make_trajectory

    n = len(versions)
    return make_trajectory(id="r1/p/0", prompt_id="p", dataset_version="d", policy_versions=versions,
                           tokenizer_hash="t", prompt_tokens=[1, 2], response_tokens=list(range(3, 3 + n)),
                           behavior_logprobs=[-0.5] * n, reward_components={"correct": 1.0}, grader_version="g",
                           terminal_reason="length", rollout_started_at=0.0, scored_at=1.0,
                           weights={str(v): "abc" for v in set(versions)}, segments=segments)


def test_segments_travel_with_the_trajectory_and_give_each_tokens_kv_version():
    from megatron_rl.trajectory import Trajectory, validate

    t = _traj([1, 1, 2, 2, 2], [[0, 2, 1, 1], [2, 5, 2, 1]])  # a keep_kv refit at token 2
    validate(t, tokenizer_hash="t", current_version=2)
    back = Trajectory.from_bytes(t.to_bytes())
    validate(back, tokenizer_hash="t")
    assert back.segments == [[0, 2, 1, 1], [2, 5, 2, 1]]
    assert back.kv_versions.tolist() == [1, 1, 1, 1, 1]
    assert _traj([1, 1], []).kv_versions.tolist() == [1, 1]  # rounds: the KV of the token's own version
    assert "segments" not in _traj([1, 1], []).to_bytes().decode("latin-1")  # older checksums unchanged


@pytest.mark.parametrize("segments", [
    [[0, 2, 1, 1], [3, 5, 2, 2]],          # a gap
    [[0, 2, 1, 1], [2, 4, 2, 2]],          # does not reach the end
    [[0, 2, 1, 1], [2, 5, 3, 3]],          # a version the tokens do not carry
    [[0, 2, 1, 2], [2, 5, 2, 2]],          # KV newer than the weights that sampled
    [[0, 5, 1]],                           # not [start, end, version, kv_version]
])
def test_segments_that_do_not_describe_the_response_are_refused(segments):
    from megatron_rl.trajectory import TrajectoryError, validate

    with pytest.raises(TrajectoryError, match="segments must tile the response"):
        validate(_traj([1, 1, 2, 2, 2], segments))


def test_a_provisional_label_and_its_confirmed_one_make_one_segment():
    from megatron_rl.rollout.requests import merged_segments
    from megatron_rl.rollout.stream_engine import Segment

    spans = [Segment(0, 3, 1, 1), Segment(3, 5, 1, 1), Segment(5, 9, 2, 1), Segment(9, 12, 2, 2)]
    assert merged_segments(spans) == [[0, 5, 1, 1], [5, 9, 2, 1], [9, 12, 2, 2]]


class _Admission:
    """Test double of the coordinator's admission calls, as a StreamProducer makes them (a test sets try_admit)."""

    config = type("C", (), {"lease_ttl_s": 60.0, "batch_size": 4})()
    lookahead = 0
    admission_epoch = 0
    published = None  # no version announced yet

    def renew(self, leases):
        return len(leases)

    def release(self, leases):
        pass

    def wait_admission(self, epoch, timeout):
        time.sleep(timeout)

    def wake_admission(self):
        pass


class _Graded:  # a grade as the producer stores it
    def to_dict(self):
        return {}


def test_a_checkpoint_waits_for_a_group_admitted_while_it_paused():
    """The pause of a checkpoint must not return between a group's admission and its submission: that
    group's prompt would be drawn after the data cursor was saved (a double draw on resume)."""
    import threading

    from megatron_rl.sampling.stream_producer import StreamProducer

    admitting, go = threading.Event(), threading.Event()

    class Admission(_Admission):  # the first grant is slow
        calls = 0

        def try_admit(self, n, **_):
            Admission.calls += 1
            if Admission.calls == 1:
                admitting.set()
                go.wait(10)
                return [f"lease{k}" for k in range(n)]
            return []

    drawn = []
    producer = StreamProducer(Admission(), lambda serial, indices=None: drawn.append(serial) or (
                                  [serial], lambda: [_sample([0]), _sample([0])]),
                              lambda samples: [_Graded() for _ in samples], steps=1, groups_per_step=2, group_size=2,
                              max_groups_in_flight=2)
    from megatron_rl.sampling.producer import TrainState

    producer.start(TrainState(step=0, version=0))
    assert admitting.wait(10)
    paused: list = []
    pauser = threading.Thread(target=lambda: paused.append(producer.pause()))
    pauser.start()
    pauser.join(0.3)
    assert pauser.is_alive(), "the pause returned while a group was being admitted"
    go.set()
    pauser.join(10)
    # the one call admitted both groups of the batch: both were drawn before the save, and each is either
    # finished (a round the checkpoint keeps) or in flight (generated again at resume), never neither nor both
    finished, generating = [r.index for r in paused[0]], [g["serial"] for g in producer.in_flight()]
    assert drawn == [0, 1] and sorted(finished + generating) == [0, 1]
    producer.stop()


def test_a_checkpoint_keeps_groups_generating_and_a_resume_generates_them_again():
    """A checkpoint's pause does not wait for the groups in flight (the engines are not drained): it names
    them (serial, examples' indices, leases) and they finish after it; a run resumed from that checkpoint
    draws nothing for them but generates the same examples again under the same serials and leases."""
    import threading

    from megatron_rl.sampling.producer import TrainState
    from megatron_rl.sampling.stream_producer import StreamProducer

    release, started = threading.Event(), threading.Event()

    class Admission(_Admission):  # one batch of two groups, then nothing
        granted = False

        def try_admit(self, n, **_):
            if Admission.granted:
                return []
            Admission.granted = True
            return [f"lease{k}" for k in range(n)]

    calls = []

    def prepare(serial, indices=None):
        calls.append((serial, indices))
        indices = [100 + serial] if indices is None else indices

        def generate():
            if serial == 1:  # group 1 is long: still generating at the checkpoint
                started.set()
                release.wait(10)
            return [_sample([0]), _sample([0])]
        return indices, generate

    producer = StreamProducer(Admission(), prepare, lambda samples: [_Graded() for _ in samples], steps=1,
                              groups_per_step=2, group_size=2, max_groups_in_flight=2)
    producer.start(TrainState(step=0, version=0))
    assert started.wait(10)
    deadline = time.monotonic() + 10
    while producer.groups_done < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    rounds = producer.pause()  # returns while group 1 still generates
    saved = producer.in_flight()
    assert [r.index for r in rounds] == [0]
    assert saved == [{"serial": 1, "indices": [101], "leases": ["lease2", "lease3"]}]
    release.set()
    producer.unpause()
    assert len(producer.next(0).samples) == 4  # both groups reach the learner
    producer.stop()

    calls.clear()
    resumed = StreamProducer(Admission(), prepare, lambda samples: [_Graded() for _ in samples], steps=1,
                             groups_per_step=2, group_size=2, max_groups_in_flight=2)
    resumed.start(TrainState(step=0, version=0, rounds=rounds, in_flight=saved))
    batch = resumed.next(0)
    resumed.stop()
    assert calls == [(1, [101])]  # generated again from its recorded example; nothing new drawn
    assert sorted(batch.leases) == ["lease0", "lease1", "lease2", "lease3"]
