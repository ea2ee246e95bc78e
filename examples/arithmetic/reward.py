"""A reward function of your own, as `reward.function` takes it (README: "Your own task").

    megatron-rl train --config configs/my_task.example.yaml \
        reward.function=examples/arithmetic/reward.py:arithmetic_reward

Called once per response with keyword arguments: the prompt the policy saw, its response, the example's
reference answer, and the example's other fields (question, id, ...).  It returns named components: they
are summed into the reward and logged apart (learn/reward_correct, learn/reward_format); "correct" (0 or
1) is what eval reports as correctness.  math-verify grades the answer: "7", "7.0" and "\\boxed{7}" all
equal 7.  An exception or a timeout (reward.timeout_s) marks the sample as ungraded: it is left out of the
loss and counted, never scored 0.
"""

from math_verify import parse, verify


def arithmetic_reward(*, prompt: str, response: str, answer: str, **fields) -> dict[str, float]:
    first = response.strip().split()[0] if response.strip() else ""
    said = parse(first)  # the number the policy answered with (its first word)
    gold = parse(answer)
    return {"correct": float(bool(said) and bool(gold) and verify(gold, said)),
            "format": 0.2 * float(first.replace("-", "", 1).isdigit())}
