"""Built-in digit_max task, JSONL loader, prompt templates with a real HF tokenizer, data cursor.

    python -m pytest tests/unit/test_data.py -q
"""

from __future__ import annotations

import json
import random

import pytest

from megatron_rl.data import (
    DIGIT_MAX_TEMPLATE,
    DataCursor,
    Dataset,
    PromptTemplate,
    digit_max_reward_config,
    load_jsonl,
    make_digit_max,
)
from megatron_rl.envs.example import Example
from megatron_rl.reward import score_response

pytestmark = pytest.mark.unit


def _char_tokenizer():
    """A real HF fast tokenizer, one token per printable ASCII character."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", bos_token="<s>"), vocab


def test_digit_max_splits_are_deterministic_disjoint_and_correct():
    a, b = make_digit_max(seed=7), make_digit_max(seed=7)
    assert {k: v.dataset_version for k, v in a.items()} == {k: v.dataset_version for k, v in b.items()}
    assert make_digit_max(seed=8)["train"].dataset_version != a["train"].dataset_version
    assert (len(a["train"]), len(a["dev"]), len(a["test"])) == (800, 100, 100)
    questions = [set(ex.question for ex in a[s]) for s in ("train", "dev", "test")]
    assert not (questions[0] & questions[1]) and not (questions[0] & questions[2]) and not (questions[1] & questions[2])
    assert len(questions[0] | questions[1] | questions[2]) == 1000
    for ex in a["dev"]:
        digits = [int(d) for d in ex.question[len("max("):-1].split(",")]
        assert ex.answer == str(max(digits))
    assert DIGIT_MAX_TEMPLATE.render(a["dev"][0]) == a["dev"][0].question + "="
    with pytest.raises(ValueError, match="dev_size"):
        make_digit_max(n_digits=2, dev_size=60, test_size=40)


def test_digit_max_reward_leaves_room_above_a_random_policy():
    """A uniform random character policy must score far below what a solved task earns."""
    cfg = digit_max_reward_config()
    ds = make_digit_max(seed=0)["dev"]
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(32, 127)] + [""]  # "" stands for EOS
    random_rewards = []
    for ex in ds:
        for _ in range(8):
            response = "".join(rng.choice(alphabet) for _ in range(3))
            random_rewards.append(score_response(response, ex.answer, cfg).reward)
    solved = [score_response(ex.answer, ex.answer, cfg).reward for ex in ds]
    always_nine = [score_response("9", ex.answer, cfg).reward for ex in ds]
    random_mean = sum(random_rewards) / len(random_rewards)
    assert random_mean < 0.15
    assert sum(solved) / len(solved) == pytest.approx(1.5)
    assert sum(always_nine) / len(always_nine) - random_mean >= 0.3  # format + a cheap heuristic


def test_dataset_version_is_a_content_hash():
    exs = [Example(id="1", question="1+1", answer="2")]
    v1 = Dataset(name="a", split="train", examples=exs).dataset_version
    assert Dataset(name="b", split="dev", examples=list(exs)).dataset_version == v1
    assert Dataset(name="a", split="train", examples=[Example(id="1", question="1+1", answer="3")]).dataset_version != v1
    with pytest.raises(ValueError, match="duplicate example id '1'"):
        Dataset(name="a", split="train", examples=exs * 2)


def test_jsonl_loader(tmp_path):
    path = tmp_path / "gsm.jsonl"
    rows = [{"problem": "2+3?", "solution": "2+3=5 #### 5"}, {"problem": "half of 9?", "solution": "#### 4.5"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ds = load_jsonl(path, question_field="problem", answer_field="solution", answer_delimiter="####")
    assert [(e.id, e.question, e.answer) for e in ds] == [("1", "2+3?", "5"), ("2", "half of 9?", "4.5")]
    again = tmp_path / "copy.jsonl"
    again.write_text(path.read_text())
    assert load_jsonl(again, question_field="problem", answer_field="solution",
                      answer_delimiter="####").dataset_version == ds.dataset_version


def test_jsonl_errors_name_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "a", "answer": "1"}) + "\n" + json.dumps({"question": "b"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing field 'answer'"):
        load_jsonl(path)
    path.write_text('{"question": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        load_jsonl(path)
    path.write_text('{"question": "a", "answer": ["x"]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'answer' must be a string or number"):
        load_jsonl(path)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_prompt_template_with_hf_tokenizer():
    tok, vocab = _char_tokenizer()
    ex = Example(id="x", question="max(3,7,1)", answer="7")
    ids = PromptTemplate("{question}=", add_special_tokens=False).encode(ex, tok)
    assert ids == [vocab[c] for c in "max(3,7,1)="]
    with pytest.raises(ValueError, match="unknown field {answer}"):
        PromptTemplate("{question} -> {answer}")
    with pytest.raises(ValueError, match="must contain {question}"):
        PromptTemplate("no field")


def test_cursor_covers_each_epoch_and_resumes_exactly():
    cursor = DataCursor(10, seed=3, dataset_version="v")
    first = cursor.next_indices(7)
    state = cursor.state_dict()
    rest = cursor.next_indices(13)  # 3 from epoch 0, 10 from epoch 1
    assert sorted(first + rest[:3]) == list(range(10))
    assert sorted(rest[3:]) == list(range(10))
    assert first + rest[:3] != rest[3:]  # reshuffled per epoch
    resumed = DataCursor(10, seed=3, dataset_version="v")
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert resumed.next_indices(13) == rest
    with pytest.raises(ValueError, match="num_examples=10"):
        DataCursor(11, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_version='v'"):
        DataCursor(10, seed=3, dataset_version="w").load_state_dict(state)
    assert DataCursor(4, shuffle=False).next_indices(6) == [0, 1, 2, 3, 0, 1]


def test_jsonl_max_tokens_is_the_prompts_response_budget(tmp_path):
    from megatron_rl.rollout.requests import prompt_params
    from megatron_rl.rollout.sample import PromptInfo

    path = tmp_path / "budget.jsonl"
    path.write_text(json.dumps({"question": "a", "answer": "1", "max_tokens": 8}) + "\n"
                    + json.dumps({"question": "b", "answer": "2"}) + "\n")
    ds = load_jsonl(path)
    assert [e.max_tokens for e in ds] == [8, None]
    plain = Dataset(name="x", split="train", examples=[Example(id="1", question="a", answer="1"),
                                                        Example(id="2", question="b", answer="2")])
    assert ds.dataset_version != plain.dataset_version  # the budget changes what is generated
    params = {"max_tokens": 200, "seed": 3}
    info = [PromptInfo(max_tokens=e.max_tokens) for e in ds]
    assert prompt_params(params, info, 0) == {"max_tokens": 8, "seed": 3}
    assert prompt_params(params, info, 1) is params
    assert prompt_params({"max_tokens": 4}, info, 0)["max_tokens"] == 4  # rollout.max_tokens still caps it
    with pytest.raises(ValueError, match="prompt 0: max_tokens must be an int >= 1"):
        prompt_params(params, [PromptInfo(max_tokens=0)], 0)
    for bad in (0, "8", 2.5, True):
        path.write_text(json.dumps({"question": "a", "answer": "1", "max_tokens": bad}) + "\n")
        with pytest.raises(ValueError, match=r"budget.jsonl:1: field 'max_tokens' must be an int >= 1"):
            load_jsonl(path)
    with pytest.raises(ValueError, match="example '1': max_tokens must be an int >= 1"):
        Example(id="1", question="a", answer="1", max_tokens=-2)
