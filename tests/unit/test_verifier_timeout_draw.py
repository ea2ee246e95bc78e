"""The verifier_timeout fault's draw (fault_hooks.py `hangs`): per input (the same input hangs every time) or
per call (a share of calls, whatever they grade)."""

from __future__ import annotations

import pytest

from megatron_rl.fault_hooks import hangs


def test_per_input_follows_the_input_and_per_call_the_share():
    spec = {"fault": "verifier_timeout", "fraction": 0.1}
    inputs = [(str(d), str(r)) for d in range(10) for r in range(10)]
    per_input = [hangs(spec, a, b) for a, b in inputs]
    assert per_input == [hangs(spec, a, b) for a, b in inputs]  # deterministic
    same = [hangs(spec, "7", "7") for _ in range(1000)]  # a policy that converged on one answer
    assert len(set(same)) == 1                           # hangs always or never
    calls = [hangs({**spec, "per": "call"}, "7", "7") for _ in range(20000)]
    assert 0.09 < sum(calls) / len(calls) < 0.11         # a tenth of the calls, whatever they grade
    with pytest.raises(ValueError, match="per must be 'input' or 'call'"):
        hangs({**spec, "per": "sometimes"}, "7", "7")
