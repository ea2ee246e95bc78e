"""Prompts longer than the engine takes are dropped before the run, counted per split (issue 30, defect 7).

    python -m pytest tests/unit/test_prompt_length.py -q

Before, such a prompt passed `train --dry-run` and vLLM refused it in the middle of the run
(VLLMValidationError, rc 1).  The limit is rollout.max_model_len - rollout.max_tokens unless
data.max_prompt_tokens sets a smaller one; drops are logged, written to run_manifest.json and
printed by the dry run; a split left empty is an error naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import ConfigError, DataError
from megatron_rl.data.dataset import Dataset, PromptTemplate
from megatron_rl.envs.example import Example
from megatron_rl.models.tokenizer import build_tokenizer

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SCRATCH = str(REPO / "configs" / "tiny_cpu_scratch.yaml")  # rollout.max_model_len 64, max_tokens 2: 62 tokens


def _split(name: str, lengths: list[int]) -> Dataset:
    """Questions of the given lengths in characters (one token each under the char tokenizer)."""
    return Dataset(name="fake", split=name, examples=[Example(id=f"{name}{i}", question="7" * n, answer="7")
                                                      for i, n in enumerate(lengths)])


def test_prompts_over_the_limit_are_dropped_and_counted_per_split(caplog):
    from megatron_rl.data.prompt_length import fit_prompts

    tok = build_tokenizer()
    template = PromptTemplate("{question}=")  # one more token than the question
    assert len(template.encode(_split("x", [9])[0], tok)) == 10
    splits = {"train": _split("train", [3, 9, 10, 40, 5]), "dev": _split("dev", [2, 2]),
              "test": _split("test", [12, 1])}
    with caplog.at_level("INFO"):
        fitted = fit_prompts(splits, template, tok, max_prompt_tokens=10)
    assert fitted.dropped == {"train": 2, "dev": 0, "test": 1}
    assert [ex.id for ex in fitted.splits["train"]] == ["train0", "train1", "train4"]  # 10 tokens fit, 11 do not
    assert fitted.splits["dev"] is splits["dev"]  # untouched: same examples, same dataset_version
    assert fitted.record() == {"max_prompt_tokens": 10, "prompts_dropped": {"train": 2, "dev": 0, "test": 1},
                               "longest_prompt": {"train": 41, "dev": 3, "test": 13}}
    assert "dropped 2 of 5 prompts longer than 10 tokens" in caplog.text


def test_a_split_with_no_prompt_short_enough_is_an_error_naming_it():
    from megatron_rl.data.prompt_length import fit_prompts

    splits = {"train": _split("train", [3]), "dev": _split("dev", [30, 31]), "test": _split("test", [1])}
    with pytest.raises(DataError, match=r"data split 'dev': all 2 prompts are longer than the 20-token limit.*"
                                        r"the shortest has 31 tokens"):
        fit_prompts(splits, PromptTemplate("{question}="), build_tokenizer(), max_prompt_tokens=20)


def test_the_limit_defaults_to_the_engines_room_and_a_larger_one_is_refused():
    from megatron_rl.train.config import load_train_config

    assert load_train_config(SCRATCH).prompt_token_limit == 62
    assert load_train_config(SCRATCH, ["rollout.max_model_len=100", "rollout.max_tokens=10"]).prompt_token_limit == 90
    assert load_train_config(SCRATCH, ["data.max_prompt_tokens=20"]).prompt_token_limit == 20
    assert load_train_config(SCRATCH, ["rollout.engine_options={max_model_len: 80}"]).prompt_token_limit == 78
    with pytest.raises(ConfigError, match=r"data.max_prompt_tokens \(63\) is more than rollout.max_model_len - "
                                          r"rollout.max_tokens \(64 - 2 = 62\)"):
        load_train_config(SCRATCH, ["data.max_prompt_tokens=63"])
    with pytest.raises(ConfigError, match=r"rollout.max_tokens \(64\) leaves no room for a prompt in "
                                          r"rollout.max_model_len \(64\)"):
        load_train_config(SCRATCH, ["rollout.max_tokens=64"])
    with pytest.raises(ConfigError, match="data.max_prompt_tokens must be >= 1"):
        load_train_config(SCRATCH, ["data.max_prompt_tokens=0"])


def _jsonl(path: Path, questions: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in questions))
    return path


def test_the_dry_run_reports_the_prompts_dropped_per_split(capsys, tmp_path):
    """A long-tailed JSONL task: 6 of 40 training questions are longer than the engine's 62 tokens."""
    questions = [f"{i}+0" for i in range(34)] + ["9" * (61 + i) + "+0" for i in range(6)]  # 63-68 tokens
    train = _jsonl(tmp_path / "train.jsonl", questions)
    test = _jsonl(tmp_path / "test.jsonl", ["100+1", "9" * 70])
    args = ["train", "--config", SCRATCH, "--dry-run", f"run.dir={tmp_path / 'run'}", "data.task=jsonl",
            f"data.train_file={train}", f"data.test_file={test}", "data.holdout_fraction=0.1"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)["data"]
    assert data["max_prompt_tokens"] == 62
    dropped = data["prompts_dropped"]
    assert dropped["test"] == 1 and dropped["train"] + dropped["dev"] == 6, data
    assert data["train"] + data["dev"] == 34 and data["test"] == 1
    assert data["longest_prompt"]["test"] == 70

    assert main([*args, "rollout.max_model_len=6"]) == 2  # 4 tokens: "100+1" (5) and the long one do not fit
    assert "data split 'test': all 2 prompts are longer than the 4-token limit" in capsys.readouterr().err


def test_the_run_manifest_records_the_drops(tmp_path, monkeypatch):
    """open_run_dir (what train and sft do first) drops the prompts and records the counts."""
    import megatron_rl.ranks.build as learner_build
    from megatron_rl.train.config import load_train_config
    from megatron_rl.train.run_setup import open_run_dir

    monkeypatch.setattr(learner_build, "seed_everything", lambda *a: None)  # leave this process's torch alone
    train = _jsonl(tmp_path / "train.jsonl", [f"{i}+0" for i in range(20)] + ["8" * 80])
    dev = _jsonl(tmp_path / "dev.jsonl", ["1+2", "8" * 62, "8" * 61])  # 63 and 62 tokens with the template
    test = _jsonl(tmp_path / "test.jsonl", ["3+4"])
    cfg = load_train_config(SCRATCH, [f"run.dir={tmp_path / 'run'}", "data.task=jsonl", f"data.train_file={train}",
                                      f"data.dev_file={dev}", f"data.test_file={test}", "data.template='{question}='"])
    inputs = open_run_dir(cfg, kind="train")
    assert inputs.prompts_dropped == {"train": 1, "dev": 1, "test": 0}
    assert len(inputs.splits["train"]) == 20 and len(inputs.splits["dev"]) == 2
    manifest = json.loads((tmp_path / "run" / "run_manifest.json").read_text())
    assert manifest["prompts"]["prompts_dropped"] == {"train": 1, "dev": 1, "test": 0}
    assert manifest["prompts"]["max_prompt_tokens"] == 62
    assert manifest["identity"]["dataset_version"] == inputs.splits["train"].dataset_version
