"""groups_as_completed without an engine: groups in completion order, bounded in-flight, provenance kept.

    python -m pytest tests/unit/test_stream_groups.py -q

The same on the real engine: tests/e2e/test_stream_refit.py::test_groups_arrive_in_completion_order.
"""

import asyncio
import random

import pytest

from megatron_rl.rollout.stream_engine import Segment, StreamResult
from megatron_rl.rollout.requests import to_sample
from megatron_rl.rollout.sample import PromptInfo
from megatron_rl.rollout.stream_groups import groups_as_completed

pytestmark = pytest.mark.unit


class FakeStream:
    """StreamEngine.generate's shape: one token per tick of 1 ms; records the most requests in flight."""

    def __init__(self, fail: str | None = None):
        self.in_flight, self.most, self.fail, self.submitted = 0, 0, fail, []

    async def generate(self, rid, prompt, sampling):
        self.submitted.append(rid)
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            n = sampling["max_tokens"]
            await asyncio.sleep(0.001 * n)
            if rid == self.fail:
                raise RuntimeError(f"{rid} failed")
            return StreamResult(rid, prompt, list(range(n)), [-0.5] * n, "length", [Segment(0, n, 3, 3)])
        finally:
            self.in_flight -= 1


def collect(stream, prompts, lengths, group_size, capacity):
    async def run():
        return [(g, samples) async for g, samples in groups_as_completed(
            stream, prompts, lambda g, s: {"max_tokens": lengths[g][s], "seed": 10 * g + s}, group_size, capacity)]

    return asyncio.run(run())


def test_a_long_tailed_workload_returns_groups_out_of_submission_order():
    rng = random.Random(0)
    G, groups = 4, 12
    lengths = [[256 if rng.random() < 0.15 else 8 for _ in range(G)] for _ in range(groups)]
    lengths[0] = [8, 8, 256, 8]  # the first group submitted has a long sample
    prompts = [[1, g + 5] for g in range(groups)]
    stream = FakeStream()
    got = collect(stream, prompts, lengths, G, capacity=8)
    order = [g for g, _ in got]
    assert sorted(order) == list(range(groups)) and order != sorted(order)
    assert order.index(0) > order.index(1), order  # a later, short group overtook the long one
    assert stream.most <= 8 and stream.submitted[:G] == [f"g0-{s}" for s in range(G)]  # prompt-major
    for g, samples in got:
        assert [s.sampling["seed"] for s in samples] == [10 * g + s for s in range(G)]  # sample order kept
        assert [len(s.response_tokens) for s in samples] == lengths[g]
        assert all(s.prompt_tokens == prompts[g] for s in samples)


def test_a_group_is_yielded_only_when_its_last_sample_finished():
    lengths = [[8, 200], [8, 8], [8, 8]]
    got = collect(FakeStream(), [[1], [2], [3]], lengths, 2, capacity=6)
    assert [g for g, _ in got] == [1, 2, 0]
    last = {g: max(s.finished_at for s in samples) for g, samples in got}
    assert last[0] > max(last[1], last[2])


def test_a_failed_request_ends_the_iteration_and_cancels_the_rest():
    stream = FakeStream(fail="g1-0")
    with pytest.raises(RuntimeError, match="g1-0 failed"):
        collect(stream, [[1], [2], [3]], [[300, 300], [8, 8], [8, 8]], 2, capacity=4)
    assert stream.in_flight == 0


def test_to_sample_spreads_segments_over_tokens():
    result = StreamResult("r", [1, 2], [7, 8, 9, 10], [-1.0] * 4, "stop",
                          [Segment(0, 1, 3, 3), Segment(1, 3, 4, 3), Segment(3, 4, 5, 5)])
    s = to_sample(result, {"seed": 1}, 1.0, 2.0, PromptInfo(id="p0", round=2))
    assert s.policy_versions == [3, 4, 4, 5] and s.segments == [[0, 1, 3, 3], [1, 3, 4, 3], [3, 4, 5, 5]]
    assert s.finish_reason == "stop" and s.prompt == PromptInfo(id="p0", round=2) and s.seconds == 1.0
    s.check()


def test_sampled_logprobs_reads_vllms_flat_and_nested_forms_alike():
    from vllm.logprobs import FlatLogprobs, Logprob

    from megatron_rl.rollout.requests import sampled_logprobs

    tokens = [7, 3, 9]
    nested = [{7: Logprob(-0.5, 4, None)}, {3: Logprob(-1.25, 1, None), 8: Logprob(-0.1, 1, None)},
              {9: Logprob(-2.0, 9, None)}]
    flat = FlatLogprobs()
    for position in nested:
        flat.append(position)
    assert sampled_logprobs(flat, tokens) == sampled_logprobs(nested, tokens) == [-0.5, -1.25, -2.0]
    assert sampled_logprobs(flat[1:], tokens[1:]) == [-1.25, -2.0]  # a DELTA output's slice
    assert sampled_logprobs(None, []) == []
