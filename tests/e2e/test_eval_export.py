"""A reasoning-gym task trains end to end; its trained policy leaves the system and evaluates the same.

    python -m pytest tests/e2e/test_eval_export.py -q

One short GRPO run on reasoning-gym's basic_arithmetic (graded by the generator's own scorer),
then `megatron-rl eval --run`: the newest COMMITTED checkpoint is exported to a Hugging Face
directory, a fresh vLLM engine scores the hidden test split greedily, and the result must
equal the run's own final eval (same weights, same decoding).  Eval must not touch the
training queue's write-ahead log.

The module's runs start two at a time (`runs`): the reasoning-gym run beside the sft.first run, then the
eval beside the convert and the `sft` rerun; each test reads, and checks, its own runs.
"""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pytest

from tests.e2e.conftest import TINY, last_json, read_jsonl, start_cli, wanted

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TASK = ["data.task=reasoning_gym", "data.generator=basic_arithmetic",
        'data.generator_config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}',
        "data.train_size=300", "data.holdout_size=40", "data.eval_size=24", "reward.grader=reasoning_gym",
        "rollout.max_model_len=96", "rollout.max_tokens=3"]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


SFT_ARGS = ["sft.steps=6", "run.checkpoint_every=3", "data.eval_size=32", "run.steps=2", "run.eval_every=0",
            "dynamic_sampling.enabled=true", "dynamic_sampling.max_attempts=3"]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every CLI run of the module, two at a time: the rg train beside the sft.first train, then `eval --run`
    (rg) beside `convert` and the `sft` rerun (sft.first).  A run after a failed one is not started; the
    tests read each run's result (`.result()`: it fails as run_cli did) in their own order.  What a test read
    between two of its runs is kept here as it was then (`before_eval`, `before_convert`)."""
    tmp = tmp_path_factory.mktemp("eval_export")
    r = SimpleNamespace(rg_dir=tmp / "rg", run=tmp / "run", hf=tmp / "hf", eval=None, convert=None, again=None)
    r.sft_dir = r.run / "sft"
    r.rg = start_cli("train", "--config", str(TINY), f"run.dir={r.rg_dir}", "run.steps=2", "run.checkpoint_every=2",
                     "run.eval_every=0", *TASK) if wanted(request, "rg_runs") else None
    r.first = start_cli("train", "--config", str(TINY), f"run.dir={r.run}", "sft.first=true",
                        *SFT_ARGS) if wanted(request, "sft_runs") else None
    started = [s for s in (r.rg, r.first) if s is not None]
    try:
        if r.rg is not None and r.rg.finish().returncode == 0:
            r.before_eval = _kept(lambda: _rg_run(r))
            if not isinstance(r.before_eval, Exception):
                r.eval = start_cli("eval", "--run", str(r.rg_dir), "--json")
                started.append(r.eval)
        if r.first is not None and r.first.finish().returncode == 0:
            r.before_convert = _kept(lambda: _sft_stage(r))
            if not isinstance(r.before_convert, Exception):
                r.convert = start_cli("convert", "mcore-to-hf", "--mcore", str(r.before_convert.step), "--out",
                                      str(r.hf))
                started.append(r.convert)
            if r.convert is not None and r.convert.finish().returncode == 0:
                r.again = start_cli("sft", "--config", str(TINY), f"run.dir={r.sft_dir}", *SFT_ARGS)
                started.append(r.again)
        for s in started:
            s.finish()
    finally:
        for s in started:
            s.kill()  # only after an error here: each one has finished otherwise
    return r


def _kept(read):
    """What read() gives now, or the error it raised: `_got` raises it in the test that reads it, not here,
    where it would error the other test too."""
    try:
        return read()
    except Exception as err:  # noqa: BLE001 -- raised again by _got
        return err


def _got(kept):
    if isinstance(kept, Exception):
        raise kept
    return kept


def _rg_run(r) -> SimpleNamespace:
    rows = read_jsonl(r.rg_dir / "metrics" / "metrics.jsonl")
    own = read_jsonl(r.rg_dir / "eval" / "test_step_000002.jsonl")  # `eval --run` writes this file anew
    return SimpleNamespace(final=[x for x in rows if "eval/test_correctness" in x][-1], wal=_sha(r.rg_dir / "queue.db"),
                           responses={o["id"]: o["responses"] for o in own})


def _sft_stage(r) -> SimpleNamespace:
    sft_ckpts = sorted((r.sft_dir / "checkpoints").iterdir())
    return SimpleNamespace(
        sft_rows=read_jsonl(r.sft_dir / "metrics" / "metrics.jsonl"), sft_ckpts=[p.name for p in sft_ckpts],
        sft_committed=[(p / "COMMITTED").is_file() for p in sft_ckpts],
        sft_manifest=json.loads((r.sft_dir / "run_manifest.json").read_text()),
        sft_model_config=(r.sft_dir / "model" / "config.json").read_text(),
        learner_log=(r.run / "logs" / "ray_LearnerWorker.log").read_text(),
        step=max(p for p in (r.run / "checkpoints").iterdir() if (p / "COMMITTED").is_file()))


@pytest.fixture(scope="module")
def rg_runs(runs):
    return runs


@pytest.fixture(scope="module")
def sft_runs(runs):
    return runs


def test_reasoning_gym_run_exports_and_evaluates_identically(rg_runs):
    run = rg_runs.rg_dir
    summary = last_json(rg_runs.rg.result().stdout)
    assert summary["steps"] == 2
    final, wal = _got(rg_runs.before_eval).final, _got(rg_runs.before_eval).wal

    proc = rg_runs.eval.result()
    result = last_json(proc.stdout)
    # Quiet: vLLM and Ray start-up output is in the eval's log file, not on the console.
    assert len(proc.stderr.splitlines()) <= 10, proc.stderr[-3000:]
    logs = run / "eval" / "logs"
    assert "mcore_to_hf" in (logs / "eval.log").read_text()
    assert any("vllm" in p.read_text().lower() for p in logs.glob("ray_*.log")), sorted(logs.iterdir())
    assert result["grader_version"].startswith("reasoning_gym-")
    assert result["decoding"] == {"samples": 1, "temperature": 0.0, "seed": 0} and result["examples"] == 24
    # The exported checkpoint through a fresh engine: the run's own final greedy eval, exactly -- each response.
    outcomes = read_jsonl(run / "eval" / "test_step_000002.jsonl")
    own = _got(rg_runs.before_eval).responses
    differ = {o["id"]: (own.get(o["id"]), o["responses"]) for o in outcomes if own.get(o["id"]) != o["responses"]}
    assert not differ and len(own) == 24, f"{len(differ)} of 24 responses differ (run's, eval's): {differ}"
    assert result["correctness"] == pytest.approx(final["eval/test_correctness"], abs=1e-12)
    assert result["reward"] == pytest.approx(final["eval/test_reward"], abs=1e-12)
    assert (run / "export" / "step_000002" / "model.safetensors").is_file()
    manifest = json.loads((run / "eval" / "test_step_000002.manifest.json").read_text())
    assert result["manifest"].endswith("test_step_000002.manifest.json") and manifest["kind"] == "eval"
    assert manifest["identity"]["grader_version"] == result["grader_version"]
    assert manifest["attempts"][-1]["ended_at"] is not None
    assert len(outcomes) == 24 and all(len(o["responses"]) == 1 for o in outcomes)
    assert all(0.0 <= o["correctness"][0] <= 1.0 for o in outcomes)  # the generator's score (partial credit too)
    assert _sha(run / "queue.db") == wal  # eval never reads or writes the training queue
    assert json.loads((run / "config.json").read_text())["data"]["task"] == "reasoning_gym"


def test_sft_baseline_then_grpo_starts_from_it(sft_runs):
    # sft.first: one `train` command runs the SFT baseline in RUN_DIR/sft, then GRPO from its result.
    run, sft_dir = sft_runs.run, sft_runs.sft_dir
    grpo = last_json(sft_runs.first.result().stdout)
    before = _got(sft_runs.before_convert)  # RUN_DIR/sft as the sft.first run left it (before convert and the rerun)
    nll = [r["sft/nll_per_token"] for r in before.sft_rows if "sft/nll_per_token" in r]
    assert len(nll) == 6 and nll[-1] < 0.5 * nll[0]  # supervised loss on the answers falls
    assert before.sft_ckpts == ["step_000003", "step_000006"]
    assert all(before.sft_committed)
    assert before.sft_manifest["kind"] == "sft"
    assert json.loads((run / "config.json").read_text())["model"]["init_from"] == str(sft_dir)
    # The baseline's test figures are GRPO's step-0 eval (the same weights): the SFT stage starts no engine of
    # its own and logs no test eval (train/sft.py sft_baseline).
    assert grpo["baseline"] == "sft" and grpo["sft_steps"] == 6
    assert grpo["initial_test_correctness"] == grpo["baseline_test_correctness"] is not None
    assert not [r for r in before.sft_rows if "eval/test_correctness" in r]
    # The SFT stage's learner actor is GRPO's learner: one learner process, rebuilt for GRPO (train/engine_pool.py).
    learner_log = before.learner_log.splitlines()
    assert len({line.split(",")[0] for line in learner_log if line.startswith("(pid=")}) == 1
    assert [line for line in learner_log if "rebuilt in its process" in line and "sft/export" in line]
    # The policy GRPO trained from the SFT run leaves the system (issue 30): `convert mcore-to-hf` finds the
    # config and tokenizer of the model the run started from (tests/unit/test_run_model_dir.py: every way).
    sft_runs.convert.result()  # `convert mcore-to-hf --mcore before.step --out sft_runs.hf`
    assert (sft_runs.hf / "config.json").read_text() == before.sft_model_config
    # `sft` rerun on the finished stage resumes at its last step: no step redone; its final test eval, on a
    # fresh engine serving the exported checkpoint, agrees with GRPO's step 0 (same weights, same decoding).
    again = last_json(sft_runs.again.result().stdout)
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
