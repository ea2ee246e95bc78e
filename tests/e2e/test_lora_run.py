"""A LoRA training run end to end: adapters published, checkpointed, resumed, and exported.

    python -m pytest tests/e2e/test_lora_run.py -q

The quickest whole recipe (configs/tiny_cpu_scratch.yaml: GRPO from a random tiny model, sync, Megatron
learner, vLLM CPU engine, Ray coordinator) with learner.lora.enabled: 2 steps with a checkpoint, then
resumed to 3.  Each publication is the adapter alone and passes the refit check (the engine with the
adapter vs the learner with it); checkpoints hold adapters only; the run manifest, the summary and the
metrics say LoRA.  Then `megatron-rl convert lora-export` writes the final checkpoint as a PEFT adapter
and a merged model, and transformers (with PEFT, and merged) answers the hidden test greedily exactly as
the run's own final eval did.  (A streaming LoRA run, whose assertions read timing, is
tests/e2e/test_lora_streaming.py.)  A second run composes LoRA with multi-turn episodes
(guess_number on the streaming engine, test_episodes.py's recipe without its SFT stage): each turn of an
episode is sampled under the adapter it started with.  It runs alone: beside the first run, in the shared Ray
cluster, the resumed run's actor logs (which the first run's tests read) did not reach its driver.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e.conftest import TINY, last_json, read_jsonl, run_cli
from tests.e2e.test_episodes import EPISODES

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LORA = ["learner.lora.enabled=true", "learner.lora.rank=8", "learner.lora.alpha=16", "learner.lr=0.003",
        "run.checkpoint_every=2", "run.keep_checkpoints=3", "run.eval_every=0", "data.eval_size=16"]


ADAPTIVE_KL = ["loss.kl_control=adaptive", "loss.kl_target=1e-6", "loss.kl_horizon=1"]
"""The first run also adapts its KL coefficient (grpo/kl_control.py), at the fastest rate, toward a target below
any KL it measures: β moves at every step, and its value must survive the resume."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora_run") / "run"
    first = run_cli("train", "--config", str(TINY), f"run.dir={run_dir}", "run.steps=2", *LORA, *ADAPTIVE_KL)
    resumed = run_cli("train", "--config", str(TINY), f"run.dir={run_dir}", "run.steps=3", *LORA, *ADAPTIVE_KL)
    out = tmp_path_factory.mktemp("lora_export")
    ckpt = run_dir / "checkpoints" / "step_000003"
    run_cli("convert", "lora-export", "--mcore", str(ckpt), "--out", str(out / "peft"), "--merged", str(out / "merged"))
    return run_dir, last_json(first.stdout), last_json(resumed.stdout), out


def test_the_run_trains_adapters_and_says_lora(run):
    run_dir, first, resumed, _ = run
    assert first["steps"] == 2 and resumed["steps"] == 3 and resumed["version"] == 3
    assert resumed["training"].startswith("LoRA rank 8, alpha 16")
    assert json.loads((run_dir / "run_manifest.json").read_text())["training"] == resumed["training"]
    rows = [r for r in read_jsonl(run_dir / "metrics" / "metrics.jsonl") if "learn/adapter_norm" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["learn/adapter_update_ratio"] > 0 and r["system/time_publish_s"] > 0 for r in rows)
    assert rows[-1]["learn/kl_ref_estimate"] > 0  # the reference (adapters off) is not the policy any more
    log = (run_dir / "logs" / "ray_RolloutWorker.log").read_text()
    for version in (1, 2, 3):  # every adapter version passed the refit check before it served
        assert f"refit check of version {version}: median" in log


def test_the_adaptive_kl_coefficient_follows_its_rule_across_the_resume(run):
    """Each step's β (learn/kl_coef) is the rule applied to the steps before it: β0 = loss.kl_coef, then
    β <- β (1 + clip(KL / target - 1, ±0.2) / horizon) with each step's measured KL.  Step 3 ran after a
    resume from step 2's checkpoint, which holds the β step 3 needs (a resume that lost it uses β0 again)."""
    from megatron_rl.checkpoint import MANIFEST

    run_dir = run[0]
    config = json.loads((run_dir / "config.json").read_text())["loss"]
    target, horizon, beta = config["kl_target"], config["kl_horizon"], config["kl_coef"]
    rows = [r for r in read_jsonl(run_dir / "metrics" / "metrics.jsonl") if "learn/kl_coef" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    used = []
    for r in rows:
        assert r["learn/kl_coef"] == pytest.approx(beta, rel=1e-12), (r["step"], rows)
        used.append(r["learn/kl_coef"])
        beta *= 1 + min(max(r["learn/kl_ref_estimate"] / target - 1, -0.2), 0.2) / horizon
        if r["step"] == 2:
            saved = json.loads((run_dir / "checkpoints" / "step_000002" / MANIFEST).read_text())
            assert saved["extra"]["kl_control"] == {"control": "adaptive", "coef": pytest.approx(beta, rel=1e-12)}
    assert len(set(used)) == 3  # it moved at every step


def test_checkpoints_hold_adapters_only(run):
    run_dir = run[0]
    weights = run_dir / "checkpoints" / "step_000002" / "weights"
    assert json.loads((weights / "lora.json").read_text())["rank"] == 8
    size = sum(p.stat().st_size for p in weights.rglob("*") if p.is_file())
    model_dir = json.loads((run_dir / "run_manifest.json").read_text())["model_dir"]
    model = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    assert 0 < size < 0.5 * model  # adapters and their optimizer state, not the base


REFERENCE = Path(__file__).parent / "data" / "lora_run_reference.json"
"""The fixture `run`'s two commands run with the code before the rollout-side redesign (ef96f5b, issue 45), on
an Intel AVX512 machine: loss and grad norm at every step and a digest of every checkpoint's weights
(`python -m benchmarks.differential_run RUN_DIR --record FILE`).  Another machine kind adds its own file
(lora_run_reference_<kind>.json), recorded there with that code."""


def test_the_run_is_bit_identical_to_the_one_recorded_before_the_redesign(run):
    """The redesign (LoRA decided in its own modules, typed samples, the rollout seam) changed no number of a
    LoRA run across its resume.  Bit-identity holds for one torch build and CPU kernel set: on another machine
    kind the recording is not comparable and the test says so instead of passing."""
    from benchmarks.differential_run import compare, figures, machine, recording_for

    recorded = [json.loads(p.read_text()) for p in sorted(REFERENCE.parent.glob(REFERENCE.stem + "*.json"))]
    want = recording_for(recorded, machine())
    if want is None:
        pytest.skip(f"recorded on {[r['machine'] for r in recorded]}, this machine is {machine()}")
    assert compare(want, figures(run[0])) == []


def _greedy(model, prompts, tokenizer, max_new_tokens):
    texts = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        texts.append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    return texts


def test_the_exported_adapter_answers_like_the_runs_own_eval(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.config import from_dict
    from megatron_rl.data.config import DataConfig
    from megatron_rl.data.tasks import load_task

    run_dir, _, _, out = run
    config = json.loads((run_dir / "config.json").read_text())
    splits, template = load_task(from_dict(DataConfig, config["data"]))
    evals = {r["id"]: r["responses"][0] for r in read_jsonl(run_dir / "eval" / "test_step_000003.jsonl")}
    merged = out / "merged"
    tokenizer = AutoTokenizer.from_pretrained(str(merged))
    examples = [ex for ex in splits["test"] if ex.id in evals]
    assert len(examples) == len(evals) == 16
    prompts = [template.encode(ex, tokenizer) for ex in examples]
    want = [evals[ex.id] for ex in examples]
    max_new = config["rollout"]["max_tokens"]
    assert _greedy(AutoModelForCausalLM.from_pretrained(str(merged)).eval(), prompts, tokenizer, max_new) == want
    base_dir = json.loads((out / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(out / "peft")).eval()
    assert _greedy(peft, prompts, tokenizer, max_new) == want


@pytest.fixture(scope="module")
def lora_episodes(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora_episodes") / "run"
    episodes = [a for a in EPISODES if not a.startswith("sft.")]  # GRPO from the random tiny model
    # sync: step 2's episodes are played after version 1 is published (async would take them from version 0's)
    out = run_cli("train", "--config", str(TINY), f"run.dir={run_dir}", "run.steps=2", *LORA, *episodes,
                  "run.mode=sync")
    return run_dir, last_json(out.stdout)


def test_lora_and_multi_turn_episodes_compose(lora_episodes):
    """LoRA + multi-turn (issue 45 item 5; refused before at config load): the run trains adapters on
    episodes, every adapter version passes its refit check, and each trajectory is an episode (assistant turns
    in the loss, observations not, the environment's reward) whose turns were sampled under the adapter they
    name (D_lag at the numerics' level), one publication digest per version, none quarantined."""
    import sqlite3

    from megatron_rl.trajectory import Trajectory

    run_dir, summary = lora_episodes
    assert summary["steps"] == 2 and summary["training"].startswith("LoRA rank 8"), summary
    log = (run_dir / "logs" / "ray_StreamRolloutWorker.log").read_text()
    for version in (1, 2):
        assert f"refit check of version {version}: median" in log
    rows = [r for r in read_jsonl(run_dir / "metrics" / "metrics.jsonl") if "learn/loss" in r]
    assert [r["learn/quarantined_trajectories"] for r in rows] == [0.0, 0.0]
    # sync: every turn was sampled by the policy the learner scores it with, adapter and all (measured 1e-6; a
    # turn played on the bare base while its label said version 1 gave 0.15 at step 2)
    assert all(r["learn/d_lag/p99"] < 1e-4 for r in rows), [r["learn/d_lag/p99"] for r in rows]
    learning = [r for r in rows if r["learn/zero_variance_groups"] < 4]  # a group with a win: a gradient
    assert learning and all(r["learn/adapter_update_ratio"] > 0 for r in learning), rows
    with sqlite3.connect(run_dir / "queue.db") as db:
        trajs = [Trajectory.from_bytes(row[0]) for row in db.execute("SELECT payload FROM traj")]
    digests: dict[str, set] = {}
    assert trajs and any(0 in t.action_mask.tolist() for t in trajs)  # observations between turns, out of the loss
    for t in trajs:
        assert t.grader_version == "env:guess_number", t.grader_version
        turns = {int(v) for v, m in zip(t.policy_versions.tolist(), t.action_mask.tolist()) if m}
        assert turns and turns <= {int(v) for v in t.weights}, (t.id, turns, t.weights)
        for v, digest in t.weights.items():
            digests.setdefault(v, set()).add(digest)
    assert all(len(found) == 1 for found in digests.values()), digests
    assert max(int(v) for v in digests) >= 1, digests  # turns sampled under a trained adapter, not the bare base
