"""A reasoning-gym task trains end to end; its trained policy leaves the system and evaluates the same.

    python -m pytest tests/e2e/test_eval_export.py -q

One short GRPO run on reasoning-gym's basic_arithmetic (graded by the generator's own scorer),
then `megatron-rl eval --run`: the newest COMMITTED checkpoint is exported to a Hugging Face
directory, a fresh vLLM engine scores the hidden test split greedily, and the result must
equal the run's own final eval (same weights, same decoding).  Eval must not touch the
training queue's write-ahead log.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.e2e.conftest import TINY, last_json, read_jsonl, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TASK = ["data.task=reasoning_gym", "data.generator=basic_arithmetic",
        'data.generator_config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}',
        "data.train_size=300", "data.holdout_size=40", "data.eval_size=24", "reward.grader=reasoning_gym",
        "rollout.max_model_len=96", "rollout.max_tokens=3"]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_reasoning_gym_run_exports_and_evaluates_identically(tmp_path):
    run = tmp_path / "rg"
    summary = last_json(run_cli("train", "--config", str(TINY), f"run.dir={run}", "run.steps=2",
                                "run.checkpoint_every=2", "run.eval_every=0", *TASK).stdout)
    assert summary["steps"] == 2
    final = [r for r in read_jsonl(run / "metrics" / "metrics.jsonl") if "eval/test_correctness" in r][-1]
    wal = _sha(run / "queue.db")

    proc = run_cli("eval", "--run", str(run), "--json")
    result = last_json(proc.stdout)
    # Quiet: vLLM and Ray start-up output is in the eval's log file, not on the console.
    assert len(proc.stderr.splitlines()) <= 10, proc.stderr[-3000:]
    logs = run / "eval" / "logs"
    assert "mcore_to_hf" in (logs / "eval.log").read_text()
    assert any("vllm" in p.read_text().lower() for p in logs.glob("ray_*.log")), sorted(logs.iterdir())
    assert result["grader_version"].startswith("reasoning_gym-")
    assert result["decoding"] == {"samples": 1, "temperature": 0.0, "seed": 0} and result["examples"] == 24
    # The exported checkpoint through a fresh engine: the run's own final greedy eval, exactly.
    assert result["correctness"] == pytest.approx(final["eval/test_correctness"], abs=1e-12)
    assert result["reward"] == pytest.approx(final["eval/test_reward"], abs=1e-12)
    assert (run / "export" / "step_000002" / "model.safetensors").is_file()
    outcomes = read_jsonl(run / "eval" / "test_step_000002.jsonl")
    manifest = json.loads((run / "eval" / "test_step_000002.manifest.json").read_text())
    assert result["manifest"].endswith("test_step_000002.manifest.json") and manifest["kind"] == "eval"
    assert manifest["identity"]["grader_version"] == result["grader_version"]
    assert manifest["attempts"][-1]["ended_at"] is not None
    assert len(outcomes) == 24 and all(len(o["responses"]) == 1 for o in outcomes)
    assert all(0.0 <= o["correctness"][0] <= 1.0 for o in outcomes)  # the generator's score (partial credit too)
    assert _sha(run / "queue.db") == wal  # eval never reads or writes the training queue
    assert json.loads((run / "config.json").read_text())["data"]["task"] == "reasoning_gym"


def test_sft_baseline_then_grpo_starts_from_it(tmp_path):
    # sft.first: one `train` command runs the SFT baseline in RUN_DIR/sft, then GRPO from its result.
    run = tmp_path / "run"
    sft_dir = run / "sft"
    sft_args = ["sft.steps=6", "run.checkpoint_every=3", "data.eval_size=32", "run.steps=2", "run.eval_every=0",
                "dynamic_sampling.enabled=true", "dynamic_sampling.max_attempts=3"]
    grpo = last_json(run_cli("train", "--config", str(TINY), f"run.dir={run}", "sft.first=true", *sft_args).stdout)
    nll = [r["sft/nll_per_token"] for r in read_jsonl(sft_dir / "metrics" / "metrics.jsonl") if "sft/nll_per_token" in r]
    assert len(nll) == 6 and nll[-1] < 0.5 * nll[0]  # supervised loss on the answers falls
    assert sorted(p.name for p in (sft_dir / "checkpoints").iterdir()) == ["step_000003", "step_000006"]
    assert all((p / "COMMITTED").is_file() for p in (sft_dir / "checkpoints").iterdir())
    assert json.loads((sft_dir / "run_manifest.json").read_text())["kind"] == "sft"
    assert json.loads((run / "config.json").read_text())["model"]["init_from"] == str(sft_dir)
    # The baseline's test figures are GRPO's step-0 eval (the same weights): the SFT stage starts no engine of
    # its own and logs no test eval (train/sft.py sft_baseline).
    assert grpo["baseline"] == "sft" and grpo["sft_steps"] == 6
    assert grpo["initial_test_correctness"] == grpo["baseline_test_correctness"] is not None
    assert not [r for r in read_jsonl(sft_dir / "metrics" / "metrics.jsonl") if "eval/test_correctness" in r]
    # The SFT stage's learner actor is GRPO's learner: one learner process, rebuilt for GRPO (train/engine_pool.py).
    learner_log = (run / "logs" / "ray_LearnerWorker.log").read_text().splitlines()
    assert len({line.split(",")[0] for line in learner_log if line.startswith("(pid=")}) == 1
    assert [line for line in learner_log if "rebuilt in its process" in line and "sft/export" in line]
    # The policy GRPO trained from the SFT run leaves the system (issue 30): `convert mcore-to-hf` finds the
    # config and tokenizer of the model the run started from (tests/unit/test_run_model_dir.py: every way).
    step = max(p for p in (run / "checkpoints").iterdir() if (p / "COMMITTED").is_file())
    run_cli("convert", "mcore-to-hf", "--mcore", str(step), "--out", str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "config.json").read_text() == (sft_dir / "model" / "config.json").read_text()
    # `sft` rerun on the finished stage resumes at its last step: no step redone; its final test eval, on a
    # fresh engine serving the exported checkpoint, agrees with GRPO's step 0 (same weights, same decoding).
    again = last_json(run_cli("sft", "--config", str(TINY), f"run.dir={sft_dir}", *sft_args).stdout)
    assert again["steps"] == 6 and again["test_correctness"] == grpo["baseline_test_correctness"]
    sft_rows = read_jsonl(sft_dir / "metrics" / "metrics.jsonl")
    assert [r["step"] for r in sft_rows if "sft/loss" in r] == list(range(1, 7))
    assert [r["step"] for r in sft_rows if "eval/test_correctness" in r] == [6]
    # Dynamic sampling: every group trained on has rewards that vary, except the ones it had to
    # fill in when its attempts ran out (counted); what it discarded counts against ESR.
    rows = [r for r in read_jsonl(run / "metrics" / "metrics.jsonl") if "learn/loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["learn/zero_variance_groups"] == r["system/dynamic_filled_groups"], r
        assert 1 <= r["system/dynamic_attempts"] <= 3 and 0 < r["system/dynamic_kept_fraction"] <= 1
        if r["system/dynamic_discarded_tokens"] > 0:
            assert r["system/esr"] < 1.0
