"""The running_sum testbed task: splits, worked solutions as SFT targets, its reward, its config."""

from __future__ import annotations

import re

import pytest

from megatron_rl.config import ConfigError, DataError
from megatron_rl.data.config import DataConfig
from megatron_rl.data.dataset import PromptTemplate, content_hash
from megatron_rl.data.running_sum import RUNNING_SUM_TEMPLATE, make_running_sum, running_sum_example
from megatron_rl.data.tasks import load_task
from megatron_rl.envs.example import Example
from megatron_rl.reward.math_verifier import RewardConfig, score_response
from megatron_rl.train.sft_data import sft_batch

pytestmark = pytest.mark.unit

REWARD = RewardConfig(extractors=["last_number"], format_extractors=["last_number"], format_weight=0.0)


def test_an_example_letters_each_digit_and_writes_the_total_so_far():
    ex = running_sum_example((3, 7, 1, 4))
    assert (ex.question, ex.answer, ex.solution) == ("a3b7c1d4", "15", "a3b10c11d15")
    assert RUNNING_SUM_TEMPLATE.render(ex) == "a3b7c1d4="
    # The worked solution earns the reward; so does the bare answer; a wrong last total does not.
    assert score_response(ex.solution, ex.answer, REWARD).correctness == 1.0
    assert score_response("15", ex.answer, REWARD).correctness == 1.0
    assert score_response("a3b10c11d14", ex.answer, REWARD).correctness == 0.0


def test_splits_are_deterministic_disjoint_and_span_the_lengths():
    a, b = make_running_sum(seed=0, train_size=3000), make_running_sum(seed=0, train_size=3000)
    assert {k: v.dataset_version for k, v in a.items()} == {k: v.dataset_version for k, v in b.items()}
    assert make_running_sum(seed=1, train_size=3000)["test"].dataset_version != a["test"].dataset_version
    # No held-out list of 3 or more digits is in train (shorter ones, 110 in all, are in every split).
    held = {ex.question for s in ("dev", "test") for ex in a[s] if len(ex.question) >= 6}
    assert held and not held & {ex.question for ex in a["train"]}
    assert [len(a[s]) for s in ("train", "dev", "test")] == [3000, 200, 200]
    for ex in a["train"]:
        digits = [int(c) for c in ex.question[1::2]]
        assert ex.answer == str(sum(digits)) and ex.solution.endswith(ex.answer)
    lengths = sorted(len(ex.solution) + 1 for ex in a["train"])  # characters are tokens, then EOS
    assert lengths[len(lengths) // 10] <= 8 and lengths[9 * len(lengths) // 10] >= 32
    assert {len(ex.question) // 2 for ex in a["train"]} == set(range(1, 15))


def test_bad_sizes_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="min_digits"):
        make_running_sum(min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="too few to hold out"):
        make_running_sum(min_digits=1, max_digits=2, train_size=100)
    with pytest.raises(DataError, match="generator_config"):
        load_task(DataConfig(task="running_sum", generator_config={"max_digits": 40}))
    with pytest.raises(ConfigError, match="carry_slip, max_digits, min_digits, slip_from, got .'digits'"):
        DataConfig(task="running_sum", generator_config={"digits": 3})
    with pytest.raises(ValueError, match="carry_slip must be in"):
        make_running_sum(carry_slip=1.0)
    with pytest.raises(DataError, match="slip_from must be a digit"):
        load_task(DataConfig(task="running_sum", generator_config={"carry_slip": 0.5, "slip_from": 10}))


def test_a_careless_teacher_drops_carries_in_train_solutions_only_and_answers_stay_right():
    """carry_slip: SFT's targets carry the teacher's slips (a dropped carry, the steps after it consistent
    with the wrong total); answers and the held-out splits do not."""
    digits = (3, 9, 8, 1)  # steps 3 -> 12 (a carry adding 9) -> 20 (a carry adding 8) -> 21

    class Always:  # a teacher who slips at every step it may slip
        def random(self):
            return 0.0

    assert running_sum_example(digits, slip=0.5, rng=Always()).solution == "a3b2c0d1"  # both carries dropped
    assert running_sum_example(digits, slip=0.5, slip_from=9, rng=Always()).solution == "a3b2c10d11"
    assert running_sum_example(digits, slip=0.5, rng=Always()).answer == "21"
    clean, careless = make_running_sum(train_size=3000), make_running_sum(train_size=3000, carry_slip=0.6, slip_from=8)
    for split in ("dev", "test"):
        assert [ex.solution for ex in careless[split]] == [ex.solution for ex in clean[split]]
    assert [ex.answer for ex in careless["train"]] == [ex.answer for ex in clean["train"]]
    wrong = [not ex.solution.endswith(ex.answer) for ex in careless["train"]]
    # Lists with a carry adding 8 or 9 are slipped 6 times in 10: about half the solutions end wrong.
    assert 0.35 < sum(wrong) / len(wrong) < 0.6
    for ex in careless["train"]:  # a slip takes 10 off a step that carried, never anything else
        steps = [int(s) for s in re.findall(r"[a-z](\d+)", ex.solution)]
        adds = [int(c) for c in ex.question[1::2]]
        for before, after, d in zip([0] + steps, steps, adds):
            assert after - before in (d, d - 10) and (after - before == d or (d >= 8 and before % 10 + d >= 10))


def test_load_task_gives_the_splits_and_template():
    splits, template = load_task(DataConfig(task="running_sum", train_size=500, holdout_size=50,
                                            generator_config={"max_digits": 5}))
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [500, 50, 50]
    assert max(len(ex.question) for ex in splits["train"]) == 10 and template.template == "{question}="


class CharTokenizer:
    eos_token_id, pad_token_id = 2, 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def test_sft_learns_the_worked_solution_and_the_dataset_version_counts_it():
    ex = running_sum_example((3, 7))
    batch = sft_batch([ex], PromptTemplate("{question}="), CharTokenizer(), micro_batch_size=1)
    tokens, mask = batch["tokens"], batch["loss_mask"]
    assert tokens[0, 1:][mask[0] > 0].tolist() == [ord(c) for c in "a3b10"] + [2]
    bare = Example(id=ex.id, question=ex.question, answer=ex.answer)
    assert content_hash([bare]) != content_hash([ex])
    assert content_hash([bare]) == content_hash([Example(id=ex.id, question=ex.question, answer=ex.answer)])


def test_the_shaped_reward_counts_the_steps_right_before_the_first_wrong_one():
    from megatron_rl.data.running_sum import running_sum_reward

    ex = running_sum_example((3, 7, 1, 4))

    def score(response):
        return running_sum_reward(prompt="a3b7c1d4=", response=response, answer=ex.answer, question=ex.question)

    assert score("a3b10c11d15") == {"correct": 1.0, "steps": 0.5}
    assert score("a3b10c12d16") == {"correct": 0.0, "steps": 0.25}
    assert score("a3b10c12d15") == {"correct": 1.0, "steps": 0.25}  # right by luck: correct, half the steps
    assert score("a3c10") == {"correct": 0.0, "steps": 0.125}  # a skipped letter is a wrong step
    assert score("15") == {"correct": 1.0, "steps": 0.0} and score("") == {"correct": 0.0, "steps": 0.0}
    assert score("a3b10c11d15e19") == {"correct": 0.0, "steps": 0.5}  # an extra step changes the last number
