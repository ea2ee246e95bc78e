"""Dynamic sampling on the streaming producer (sampling/stream_producer.py, issue 45 item 5): groups whose rewards
do not vary are discarded as they finish, their leases given back, and fresh groups drawn in their place,
within the rounds' bound; past it the batch keeps them (filled).  No engine: a group's generate call returns
samples whose rewards the test chooses by serial.

    python -m pytest tests/unit/test_stream_dynamic_sampling.py -q
"""

from __future__ import annotations

import threading

import pytest

from megatron_rl.reward.math_verifier import Score
from megatron_rl.rollout.sample import RolloutSample
from megatron_rl.sampling.dynamic_sampling import DynamicSamplingConfig
from megatron_rl.sampling.producer import TrainState
from megatron_rl.sampling.stream_producer import StreamProducer
from megatron_rl.reporting.telemetry import _system_metrics


class Admission:
    """The coordinator's admission as the producer sees it: grants whatever is asked, records releases."""

    config = type("C", (), {"lease_ttl_s": 60.0, "batch_size": 4})()
    lookahead = 0
    admission_epoch = 0
    published = None  # no version announced yet

    def __init__(self):
        self.granted, self.released, self._lock = 0, [], threading.Lock()

    def try_admit(self, n, **_):
        with self._lock:
            first, self.granted = self.granted, self.granted + n
        return [f"lease{k}" for k in range(first, first + n)]

    def renew(self, leases):
        return len(leases)

    def release(self, leases):
        with self._lock:
            self.released += leases

    def wait_admission(self, epoch, timeout):
        pass

    def wake_admission(self):
        pass


def _sample(serial: int) -> RolloutSample:
    """An episode's sample: two tokens the policy generated around one observation token (mask 0)."""
    return RolloutSample(prompt_tokens=[1, serial], response_tokens=[5, 6, 7], behavior_logprobs=[-1.0, 0.0, -1.0],
                         policy_versions=[0, 0, 0], sampling={}, finish_reason="stop", started_at=0.0, finished_at=1.0,
                         action_mask=[1, 0, 1])


def _run(rewards_of, *, steps=2, ds=None) -> tuple[StreamProducer, Admission, list, list]:
    """A producer of `steps` batches of 2 groups of 2; group `serial`'s two rewards are rewards_of(serial)."""
    admission, graded = Admission(), []

    def prepare(serial, indices=None):
        return [serial], lambda: [_sample(serial), _sample(serial)]

    def grade(samples):
        rewards = rewards_of(samples[0].prompt_tokens[1])
        graded.append(samples[0].prompt_tokens[1])
        return [Score(reward=r, correctness=r, format=1.0, overlong=0.0, error=None, grader_version="g")
                for r in rewards]

    producer = StreamProducer(admission, prepare, grade, steps=steps, groups_per_step=2, group_size=2,
                              max_groups_in_flight=2,
                              dynamic=ds or DynamicSamplingConfig(enabled=True, oversample=1.5, max_attempts=2))
    producer.start(TrainState(step=0, version=0))
    batches = [producer.next(step) for step in range(steps)]
    producer.stop()
    return producer, admission, batches, graded


def test_uninformative_groups_are_discarded_their_leases_given_back_and_replaced():
    equal = {1, 2, 4}  # these serials' groups earn equal rewards
    producer, admission, batches, graded = _run(lambda n: [1.0, 1.0] if n in equal else [0.0, 1.0])
    taken = [s.prompt_tokens[1] for b in batches for s in b.samples[::2]]
    assert sorted(taken) == [0, 3, 5, 6] and not equal & set(taken)
    assert sorted(graded) == list(range(7))  # three more groups drawn than batches need: one per discard
    assert producer.groups_discarded == 3 and len(admission.released) == 6  # 2 leases per discarded group
    assert not set(admission.released) & {lease for b in batches for lease in b.leases}
    stats = [b.stats for b in batches]
    assert sum(s["sampled_groups"] for s in stats) == 7 and sum(s["informative_groups"] for s in stats) == 4
    assert all(s["filled_groups"] == 0 for s in stats)
    assert sum(s["discarded_tokens"] for s in stats) == 3 * 2 * 2  # 3 groups x 2 samples x 2 generated tokens


def test_past_the_rounds_bound_a_batch_keeps_uninformative_groups():
    """oversample 1.5, 2 attempts: a batch of 2 groups samples at most 6, so discards at most 4; every group
    earns equal rewards, so the first batch discards 4 and then keeps (fills with) the next 2.  The second
    discards 0 to 4: groups that finish before the first batch is taken still count against its budget."""
    ds = DynamicSamplingConfig(enabled=True, oversample=1.5, max_attempts=2)
    assert ds.discard_budget(2) == 4
    producer, admission, batches, graded = _run(lambda n: [0.0, 0.0], ds=ds)
    assert [len(b.samples) for b in batches] == [4, 4]
    first = batches[0].stats
    assert (first["sampled_groups"], first["informative_groups"], first["filled_groups"]) == (6, 0, 2)
    assert 4 <= producer.groups_discarded <= 8 and len(graded) == producer.groups_discarded + 4
    metrics = _system_metrics(batches[0].samples, [], {}, {"rollout": 1.0, "learn": 1.0}, batches[0].stats)
    assert metrics["system/dynamic_kept_fraction"] == 0.0 and metrics["system/dynamic_filled_groups"] == 2.0
    assert metrics["system/generated_tokens"] == 4 * 2 + 4 * 2 * 2  # the batch's generated tokens, the discarded


def test_without_dynamic_sampling_every_finished_group_is_taken():
    producer, admission, batches, graded = _run(lambda n: [1.0, 1.0], ds=DynamicSamplingConfig(enabled=False))
    assert sorted(graded) == [0, 1, 2, 3] and admission.released == [] and producer.groups_discarded == 0
    assert all("sampled_groups" not in b.stats for b in batches)


@pytest.mark.parametrize("paused", [True, False])
def test_a_group_discarded_while_a_checkpoint_is_written_keeps_its_leases_until_it_is(paused):
    admission = Admission()
    producer = StreamProducer(admission, None, None, steps=1, groups_per_step=2, group_size=2, max_groups_in_flight=2,
                              dynamic=DynamicSamplingConfig(enabled=True))
    producer.loop.paused = paused
    producer._in_flight[3] = ([3], ["a", "b"])
    producer._skip(3, ["a", "b"], [_sample(3), _sample(3)], dropped=False)
    assert admission.released == ([] if paused else ["a", "b"]) and 3 not in producer._in_flight
    producer.unpause()
    assert admission.released == ["a", "b"]


def test_a_resumed_run_goes_on_from_the_serial_the_checkpoint_recorded():
    """A checkpoint after a batch whose uninformative groups were discarded records the next serial and the
    groups skipped (pause -> serials(), train/checkpointing.py keeps it); a producer started from it draws
    new serials only (a serial seeds its group's sampling) and still fills its last batch."""
    equal = {1, 2}
    producer, _, batches, graded = _run(lambda n: [1.0, 1.0] if n in equal else [0.0, 1.0], steps=1)
    producer.pause()
    saved = producer.serials()
    assert saved == {"next_serial": max(graded) + 1, "groups_skipped": 2}
    drawn: list[int] = []

    def prepare(serial, indices=None):
        drawn.append(serial)
        return [serial], lambda: [_sample(serial), _sample(serial)]

    def grade(samples):
        return [Score(reward=r, correctness=r, format=1.0, overlong=0.0, error=None, grader_version="g")
                for r in ([1.0, 1.0] if samples[0].prompt_tokens[1] == saved["next_serial"] else [0.0, 1.0])]

    resumed = StreamProducer(Admission(), prepare, grade, steps=2, groups_per_step=2, group_size=2, max_groups_in_flight=2,
                              dynamic=DynamicSamplingConfig(enabled=True, oversample=1.5, max_attempts=2))
    resumed.start(TrainState(step=1, version=1, serials=saved))
    second = resumed.next(1)
    resumed.stop()
    assert min(drawn) == saved["next_serial"] and not set(drawn) & set(graded)
    assert len(second.samples) == 4 and resumed.groups_discarded == 1  # one more drawn for the one discarded
