"""What a user brings their own task with, short of a run: config inheritance (`base:`), the JSONL keys and
their errors, GSM8K's answer delimiter, the example task in examples/arithmetic, and what the dry run shows.

    python -m pytest tests/unit/test_own_task.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, DataError
from megatron_rl.data.jsonl import load_jsonl
from megatron_rl.data.tasks import load_task
from megatron_rl.envs.example import Example
from megatron_rl.reward.function import load_function
from megatron_rl.train.config import load_train_config
from megatron_rl.train.dry_run import check_and_plan

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "configs" / "my_task.example.yaml"


def test_a_config_inherits_its_base_and_overrides_win(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "base.yaml").write_text(
        "model: {tiny: {arch: llama}}\nlearner: {lr: 0.01, micro_batch_size: 8}\n"
        "run: {steps: 7, prompts_per_step: 8, group_size: 8}\n"
        "reward: {format_extractors: [boxed], extractors: [boxed, last_number]}\n")
    (tmp_path / "mid.yaml").write_text("base: recipes/base.yaml\nlearner: {lr: 0.02}\n")
    (tmp_path / "top.yaml").write_text("base: mid.yaml\nrun: {steps: 3}\nreward: {extractors: [boxed]}\n")
    cfg = load_train_config(tmp_path / "top.yaml", ["learner.micro_batch_size=4"])
    assert cfg.learner.lr == 0.02 and cfg.learner.micro_batch_size == 4  # mid's lr, the override's micro batch
    assert cfg.run.steps == 3 and cfg.run.prompts_per_step == 8           # top's steps, base's batch
    assert cfg.reward.extractors == ["boxed"]                             # a list is replaced whole


def test_a_null_takes_the_default_back_and_a_cycle_or_a_bad_base_is_named(tmp_path):
    (tmp_path / "base.yaml").write_text("model: {tiny: {arch: llama}}\ndata: {template: 'Q: {question}', eval_size: 9}\n")
    (tmp_path / "top.yaml").write_text("base: base.yaml\ndata: {template: null}\n")
    cfg = load_train_config(tmp_path / "top.yaml")
    assert cfg.data.template is None and cfg.data.eval_size == 9
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="leads back to itself"):
        load_train_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_train_config(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("base: [x]\n")
    with pytest.raises(ConfigError, match="base must be the file name"):
        load_train_config(tmp_path / "d.yaml")


def test_a_missing_jsonl_field_names_the_key_to_set(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+1", "solution": "2"}) + "\n")
    with pytest.raises(DataError) as err:
        load_jsonl(path)
    assert "missing field 'question' (fields present: prompt, solution): set data.question_field" in str(err.value)
    with pytest.raises(DataError, match="set data.answer_field"):
        load_jsonl(path, question_field="prompt")
    ds = load_jsonl(path, question_field="prompt", answer_field="solution")
    assert (ds[0].question, ds[0].answer) == ("1+1", "2")


def test_gsm8k_answers_keep_what_follows_the_delimiter(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"question": f"q{i}", "answer": f"work {i} #### {i * 2}"} for i in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_train_config(None, ["model.tiny.arch=llama", "data.task=jsonl", f"data.train_file={path}", "data.answer_delimiter=####"])
    splits, _ = load_task(cfg.data)
    answers = {ex.question: ex.answer for split in splits.values() for ex in split}
    assert answers == {f"q{i}": str(i * 2) for i in range(30)}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no delimiter"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: field 'answer' has no answer delimiter '####' "
                                        r"\(data.answer_delimiter\)"):
        load_jsonl(bad, answer_delimiter="####")


def test_the_example_task_loads_and_its_reward_grades_with_math_verify(monkeypatch):
    monkeypatch.chdir(REPO)  # the example's paths are relative to the checkout, as the README runs it
    cfg = load_train_config(EXAMPLE)
    assert cfg.reward.function == f"{REPO / 'examples/arithmetic/reward.py'}:arithmetic_reward"
    splits, template = load_task(cfg.data)
    assert {len(s) for s in splits.values()} and all(ex.answer.lstrip("-").isdigit() for ex in splits["train"])
    fn = load_function(cfg.reward.function)
    ex = splits["test"][0]
    kw = dict(prompt=template.render(ex), answer=ex.answer, **{k: v for k, v in ex.reward_fields().items()
                                                                if k != "answer"})
    assert fn(response=f" {ex.answer} apples", **kw) == {"correct": 1.0, "format": 0.2}
    assert fn(response=f"{int(ex.answer) + 1}", **kw) == {"correct": 0.0, "format": 0.2}
    assert fn(response="many", **kw) == {"correct": 0.0, "format": 0.0}
    assert fn(response="", **kw) == {"correct": 0.0, "format": 0.0}


def test_the_dry_run_shows_the_reward_rollout_and_training(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    cfg = load_train_config(EXAMPLE, [f"run.dir={tmp_path / 'run'}"])
    plan = check_and_plan(cfg)
    assert plan["reward"]["function"].endswith("reward.py:arithmetic_reward")
    assert plan["reward"]["grader_version"].startswith("function:arithmetic_reward@")
    assert plan["rollout"]["streaming"] is False and plan["environment"] is None
    assert plan["training"] == "full" and plan["sft_first"] is False
    assert plan["data"]["task"] == "jsonl" and plan["data"]["train"] > 0
    builtin = check_and_plan(load_train_config(REPO / "configs" / "tiny_cpu_scratch.yaml",
                                               [f"run.dir={tmp_path / 'run2'}"]))
    assert builtin["reward"]["grader"] == "math" and "function" not in builtin["reward"]


def test_reward_fields_never_shadow_the_functions_own_arguments():
    ex = Example(id="7", question="q", answer="a", metadata=json.dumps({"response": 1, "prompt": 2, "level": 3}))
    assert ex.reward_fields() == {"level": 3, "question": "q", "id": "7", "answer": "a"}


def test_a_resume_names_the_learning_keys_that_changed_and_ignores_operational_ones(tmp_path):
    from megatron_rl.train.config import resolved_dict
    from megatron_rl.train.resume import changed_on_resume, check_config_change

    base = ["model.tiny.arch=llama", f"run.dir={tmp_path}"]
    before = load_train_config(None, base)
    (tmp_path / "config.json").write_text(json.dumps(resolved_dict(before)))
    same = load_train_config(None, [*base, "run.steps=99", "run.eval_every=3", "learner.micro_batch_size=4",
                                    "data.eval_size=7", "run.use_existing_ray=true", "run.learner_timeout_s=9"])
    assert check_config_change(resolved_dict(same), tmp_path, same.run.allow_config_change) == []
    changed = load_train_config(None, [*base, "learner.lr=0.5", "reward.format_weight=0.3", "rollout.temperature=0.5"])
    with pytest.raises(ConfigError) as err:
        check_config_change(resolved_dict(changed), tmp_path, False)
    message = str(err.value)
    assert "learner.lr: 1e-06 -> 0.5" in message
    assert "reward.format_weight" in message and "rollout.temperature" in message and "run.steps" not in message
    allowed = load_train_config(None, [*base, "learner.lr=0.5", "run.allow_config_change=true"])
    assert [c.split(":")[0] for c in check_config_change(resolved_dict(allowed), tmp_path, allowed.run.allow_config_change)] == ["learner.lr"]
    assert changed_on_resume({"loss": {"kl_coef": 0.1}}, {"loss": {"kl_coef": 0.1}}) == []
    (tmp_path / "config.json").write_text("not json")
    assert check_config_change(resolved_dict(changed), tmp_path, False) == []  # nothing readable to compare with: not refused here


ROWS = [{"problem": f"{i} plus {i}?", "solution": f"work #### {2 * i}", "level": i % 3} for i in range(12)]


def _same_examples(ds, rows=ROWS):
    assert [(ex.question, ex.answer) for ex in ds] == [(r["problem"], r["solution"].split("####")[1].strip())
                                                       for r in rows]


def test_parquet_and_a_datasets_directory_load_as_jsonl_does(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    kw = dict(question_field="problem", answer_field="solution", answer_delimiter="####")
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:8]),
                          "validation": datasets.Dataset.from_list(ROWS[8:])}).save_to_disk(str(tmp_path / "dict"))
    reference = load_jsonl(jsonl, **kw)
    for path in (tmp_path / "d.parquet", tmp_path / "one"):
        ds = load_jsonl(path, **kw)
        _same_examples(ds)
        assert ds.dataset_version == reference.dataset_version  # the same rows, the same version
    _same_examples(load_jsonl(tmp_path / "dict", split="train", **kw), ROWS[:8])
    _same_examples(load_jsonl(tmp_path / "dict", split="dev", **kw), ROWS[8:])  # validation is the dev split
    with pytest.raises(DataError, match=r"no test split among \['train', 'validation'\]"):
        load_jsonl(tmp_path / "dict", split="test", **kw)
    (tmp_path / "d.bin").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="set data.format"):
        load_jsonl(tmp_path / "d.bin", **kw)
    with pytest.raises(DataError, match="not a readable Parquet file"):
        load_jsonl(tmp_path / "d.bin", fmt="parquet", **kw)
    with pytest.raises(DataError, match=r"row 3: missing field 'problem'"):
        pq.write_table(pa.Table.from_pylist([*ROWS[:2], {"solution": "#### 1"}]), tmp_path / "bad.parquet")
        load_jsonl(tmp_path / "bad.parquet", **kw)
    cfg = load_train_config(None, ["model.tiny.arch=llama", "data.task=jsonl", f"data.train_file={tmp_path / 'one'}",
                                   "data.question_field=problem", "data.answer_field=solution",
                                   "data.answer_delimiter='####'", "data.holdout_fraction=0.25"])
    splits, _ = load_task(cfg.data)
    assert sum(len(s) for s in splits.values()) == len(ROWS)
    with pytest.raises(ConfigError, match="data.format must be one of"):
        load_train_config(None, ["model.tiny.arch=llama", "data.format=csv"])


def test_chat_message_prompts_render_with_the_chat_template(tmp_path):
    from megatron_rl.data.dataset import PromptTemplate
    from tests.unit.tiny_chat import tiny_chat_tokenizer

    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}+1?"}],
             "answer": str(i + 1)} for i in range(4)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_jsonl(path)
    ex = ds[0]
    assert ex.question == "0+1?" and json.loads(ex.messages) == rows[0]["messages"]
    tok = tiny_chat_tokenizer()
    ids = PromptTemplate("{question}", chat="auto").encode(ex, tok)
    expected = tok.apply_chat_template(rows[0]["messages"], add_generation_prompt=True, tokenize=True)
    assert ids == [int(t) for t in (expected["input_ids"] if hasattr(expected, "keys") else expected)]
    assert ex.reward_fields()["messages"] == rows[0]["messages"]
    path.write_text(json.dumps({"messages": [{"role": "user"}], "answer": "1"}) + "\n")
    with pytest.raises(DataError, match="field 'messages' must be a non-empty list"):
        load_jsonl(path)


def test_only_local_packages_named_by_module_are_shipped_to_ray(tmp_path, monkeypatch):
    from megatron_rl.envs.config import EnvConfig
    from megatron_rl.plugins import local_package_dirs

    pkg = tmp_path / "my_plugins"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "envs.py").write_text((REPO / "examples" / "two_step_env" / "env.py").read_text())
    (tmp_path / "lonely.py").write_text("def f(**kw):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert local_package_dirs(["my_plugins.envs:TwoStep"]) == [str(pkg.resolve())]
    assert local_package_dirs(["yaml:safe_load", "lonely:f", f"{tmp_path}/lonely.py:f"]) == []  # installed, a
    # top-level module file, a file path: nothing to ship
    env = EnvConfig(name="my_plugins.envs:TwoStep", options={"bonus": 0.5})
    assert env.package_dirs() == [str(pkg.resolve())]
    assert EnvConfig(name="guess_number").package_dirs() == []


def test_the_dry_run_refuses_what_would_fail_late(tmp_path):
    """A model directory without weights or without a tokenizer; a number-only grader on answers that are not
    numbers; and it shows how many examples each eval really takes."""
    from megatron_rl.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "m", arch="llama", seed=0)
    base = [f"model.path={model}", f"run.dir={tmp_path / 'run'}"]
    assert check_and_plan(load_train_config(None, base))["data"]["eval_examples"]["test"] > 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).rename(model / f"{name}.away")
    with pytest.raises(ConfigError, match="no tokenizer there"):
        check_and_plan(load_train_config(None, base))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / f"{name}.away").rename(model / name)
    (model / "model.safetensors").rename(model / "model.bin")
    with pytest.raises(ConfigError, match=r"no \*.safetensors weights there"):
        check_and_plan(load_train_config(None, base))
    (model / "model.bin").rename(model / "model.safetensors")
    rows = tmp_path / "words.jsonl"
    rows.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"word{i}x"}) + "\n" for i in range(40)))
    words = [*base, "data.task=jsonl", f"data.train_file={rows}", "reward.extractors=[leading_number]",
             "reward.format_extractors=[leading_number]", "data.eval_size=50"]
    with pytest.raises(ConfigError, match="only find numbers, but none of the test split's first 4 answers"):
        check_and_plan(load_train_config(None, words))
    plan = check_and_plan(load_train_config(None, [*words, "reward.extractors=[answer_is]",
                                                   "reward.format_extractors=[answer_is]"]))
    assert plan["data"]["eval_examples"] == {"dev": 4, "test": 4}  # data.eval_size 50: the whole split


def test_a_hub_id_resolves_through_the_local_cache_and_says_how_to_fetch_it(tmp_path, monkeypatch):
    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.train.start_model import resolve_model_path

    hub = tmp_path / "hf" / "hub"
    snapshot = hub / "models--tiny-org--tiny-llama" / "snapshots" / "0123abcd"
    make_tiny_model(snapshot, arch="llama", seed=0)
    (hub / "models--tiny-org--tiny-llama" / "refs").mkdir(parents=True)
    (hub / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("tiny-org/tiny-llama") == snapshot.resolve()
    plan = check_and_plan(load_train_config(None, ["model.path=tiny-org/tiny-llama", f"run.dir={tmp_path / 'r'}"]))
    assert plan["model"] == str(snapshot.resolve())
    with pytest.raises(FileNotFoundError, match="hf download other-org/missing"):
        resolve_model_path("other-org/missing")
    (tmp_path / "local-org").mkdir()
    (tmp_path / "local-org" / "dir").mkdir()
    assert resolve_model_path("local-org/dir") == (tmp_path / "local-org" / "dir").resolve()  # a local dir wins


def test_a_gpu_recipe_on_a_machine_without_cuda_is_refused_naming_its_keys(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_train_config(REPO / "configs" / "qwen2_1.5b_1gpu.yaml", [f"run.dir={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        check_and_plan(cfg)
    assert "needs CUDA GPUs (learner.dtype bf16, rollout.dtype bfloat16)" in str(err.value)
    assert "learner.dtype=fp32 rollout.dtype=float32" in str(err.value)
