"""Tasks and graders no one here wrote: reasoning-gym generators and scorers, math-verify.

Splits come from independent seeds and are disjoint; the verifier pool grades with the
generator's own score_answer; a tokenizer that cannot write a task's characters is refused
before any work, naming them.
"""

from __future__ import annotations

import json

import pytest

from megatron_rl.data.dataset import Dataset, PromptTemplate
from megatron_rl.data.reasoning_gym_task import make_reasoning_gym
from megatron_rl.data.tasks import check_encodable
from megatron_rl.envs.example import Example
from megatron_rl.reward.math_verifier import RewardConfig, score_response
from megatron_rl.reward.pool import VerifierPool

pytestmark = pytest.mark.unit

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # ~200 distinct questions


def test_reasoning_gym_splits_are_disjoint_reproducible_and_carry_their_entries():
    a = make_reasoning_gym("chain_sum", SMALL, seed=0, train_size=300, holdout_size=50)
    b = make_reasoning_gym("chain_sum", SMALL, seed=0, train_size=300, holdout_size=50)
    assert all(a[s].dataset_version == b[s].dataset_version for s in a)
    questions = [{ex.question for ex in a[s]} for s in ("train", "dev", "test")]
    assert not (questions[0] & questions[1] or questions[0] & questions[2] or questions[1] & questions[2])
    assert len(a["train"]) < 300  # repeats of held-out questions were dropped from train
    entry = json.loads(a["test"][0].reference)
    assert entry["answer"] == a["test"][0].answer and entry["metadata"]["source_dataset"] == "chain_sum"
    other = make_reasoning_gym("chain_sum", SMALL, seed=1, train_size=300, holdout_size=50)
    assert other["test"].dataset_version != a["test"].dataset_version


def test_reasoning_gym_grader_uses_the_generators_scorer_in_the_pool():
    from importlib.metadata import version

    import reasoning_gym

    ex = make_reasoning_gym("basic_arithmetic", {}, seed=0, train_size=5, holdout_size=3)["test"][0]
    cfg = RewardConfig(grader="reasoning_gym", extractors=["leading_number"], format_extractors=["leading_number"],
                       num_workers=1, timeout_s=30.0)
    with VerifierPool(cfg) as pool:
        right, wrong = pool.score([ex.answer, str(int(ex.answer) + 1)], [ex.reference] * 2)
    scorer = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=0).score_answer
    entry = json.loads(ex.reference)
    assert right.correctness == scorer(ex.answer, entry) == 1.0
    assert wrong.correctness == scorer(str(int(ex.answer) + 1), entry) == 0.0
    assert right.grader_version.startswith(f"reasoning_gym-{version('reasoning-gym')}:")


def test_math_verify_grader_compares_boxed_answers_symbolically():
    cfg = RewardConfig(grader="math_verify")
    assert score_response(r"so the answer is \boxed{\frac{1}{2}}", "0.5", cfg).correctness == 1.0
    assert score_response(r"\boxed{3}", "0.5", cfg).correctness == 0.0
    assert cfg.grader_version().startswith("math_verify-0.9")
    with pytest.raises(ValueError, match="grader 'sympy' is not one of"):
        RewardConfig(grader="sympy")


def test_unencodable_characters_are_named_before_any_work(tmp_path):
    from transformers import AutoTokenizer

    from megatron_rl.models.tiny import make_tiny_model

    tok = AutoTokenizer.from_pretrained(str(make_tiny_model(tmp_path / "m", arch="llama", size="tiny")))
    ok = {"train": Dataset(name="t", split="train", examples=[Example(id="0", question="1 + 2", answer="3")])}
    check_encodable(ok, PromptTemplate("{question}="), tok)
    bad = {"train": Dataset(name="t", split="train", examples=[Example(id="q7", question="3 × 4", answer="12")])}
    with pytest.raises(ValueError, match=r"cannot encode 1 character\(s\) of this task: '×' \(e.g. q7\)"):
        check_encodable(bad, PromptTemplate("{question}="), tok)
