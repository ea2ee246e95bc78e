"""Multi-turn episodes in a real training run: guess_number on the streaming engine, then resumed (issue 28).

    python -m pytest tests/e2e/test_episodes.py -q

The tiny random model plays `guess_number` (1..8, 3 guesses) with the plain chat template: each
assistant turn is at most 6 tokens, an episode at most 3 turns and 200 tokens.  Run A trains 2 steps
(async, streaming, a checkpoint at step 2 with episodes in flight: they finish before the save); B
resumes the run directory to step 3.  Both start from a 3-step SFT stage on the environment's expert
demonstrations (sft.first: binary search, envs/demonstrations.py), run by A and reused by B.  What must hold:
- SFT learned the demonstrations' assistant turns only (a guess and its end of turn: 2 tokens a turn), never
  the prompt or an observation, and GRPO started from its result;
- every trajectory is one token sequence: assistant turns (mask 1, the sampler's logprobs) and the
  environment's observations between them (mask 0, logprob 0, the chat template's separators around
  the environment's own text), with segments tiling it and a terminal reason of the episode;
- the reward is the environment's (grader env:guess_number), and the env/ metrics are logged;
- the held-out evals played episodes too (greedy), and nothing was trained twice across the resume;
- (issue 45 item 5: streaming, multi-turn and dynamic sampling compose) A and B run with dynamic sampling: the
  groups each step learned from are those whose rewards vary, but for the groups the step reports as filled
  (past the discard bound), and the tokens of the discarded groups were counted;
- (issue 45 item 5) multi-turn on the round engine: run R trains 2 sync steps of the same game from scratch with
  rollout.streaming off (started beside run A: fixture `started`); its episodes are played in lockstep
  (rollout/turn_batcher.py) and hold the same contract (one sequence, masked observations, segments, the
  environment's reward, env/ metrics).
"""

from __future__ import annotations

import sqlite3

import pytest

from megatron_rl.envs.protocol import TERMINAL_REASONS
from megatron_rl.models.tokenizer import build_tokenizer
from megatron_rl.trajectory import Trajectory
from tests.e2e.conftest import TINY, last_json, read_jsonl, run_cli, start_cli, wanted

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EPISODES = ["run.mode=async", "run.prompts_per_step=4", "run.group_size=4", "learner.micro_batch_size=16",
            "run.eval_every=0", "run.checkpoint_every=2", "data.eval_size=4", "data.train_size=64",
            "data.holdout_size=8", "rollout.streaming=true", "rollout.max_tokens=6", "rollout.max_model_len=256",
            "data.task=env", "data.env.name=guess_number", "data.env.options={low: 1, high: 8, max_guesses: 3}",
            "data.env.chat_template=plain", 'data.env.system_prompt=""', "data.env.max_turns=3",
            "data.env.max_total_tokens=200", "sft.first=true", "sft.steps=3",
            "dynamic_sampling.enabled=true", "dynamic_sampling.oversample=1.5", "dynamic_sampling.max_attempts=2"]
FEEDBACK = ("higher", "lower", "No guess found", "is outside the range", "Correct!", "Out of guesses")


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """Run R, started beside run A when a selected test reads it (two at a time, tests/README.md: neither run's
    tests read timing); `rounds` reads its result."""
    d = tmp_path_factory.mktemp("episode_rounds") / "run"
    common = [o for o in EPISODES if not o.startswith(("sft.", "dynamic_sampling.", "run.mode", "rollout.streaming"))]
    proc = start_cli("train", "--config", str(TINY), f"run.dir={d}", "run.steps=2", "run.mode=sync",
                     "rollout.streaming=false", *common) if wanted(request, "rounds") else None
    yield d, proc
    if proc is not None:
        proc.kill()  # only after an error: a read run has ended


@pytest.fixture(scope="module")
def rounds(started):
    d, proc = started
    out = last_json(proc.result().stdout)
    with sqlite3.connect(d / "queue.db") as db:
        trajs = [Trajectory.from_bytes(row[0]) for row in db.execute("SELECT payload FROM traj")]
    return d, out, trajs


@pytest.fixture(scope="module")
def run(started, tmp_path_factory):
    d = tmp_path_factory.mktemp("episodes") / "run"
    a = last_json(run_cli("train", "--config", str(TINY), f"run.dir={d}", "run.steps=2", *EPISODES).stdout)
    b = last_json(run_cli("train", "--config", str(TINY), f"run.dir={d}", "run.steps=3", *EPISODES).stdout)
    with sqlite3.connect(d / "queue.db") as db:
        trajs = [Trajectory.from_bytes(row[0]) for row in db.execute("SELECT payload FROM traj")]
    return d, a, b, trajs


def test_the_run_trains_on_episodes_and_resumes(run):
    d, a, b, _ = run
    assert (a["steps"], b["steps"], b["version"]) == (2, 3, 3)
    consumed = [i for row in read_jsonl(d / "consumed.jsonl") for i in row["ids"]]
    assert len(consumed) == 3 * 16 and len(set(consumed)) == len(consumed)
    assert set(b) >= {"initial_test_correctness", "final_test_correctness"}  # evals played episodes
    evals = read_jsonl(d / "eval" / "test_step_000003.jsonl")
    assert len(evals) == 4 and all(o["errors"] == 0 and o["correctness"][0] in (0.0, 1.0) for o in evals)


def test_sft_learned_the_experts_turns_and_grpo_started_from_it(run):
    d, a, b, _ = run
    assert a["baseline"] == b["baseline"] == "sft" and a["sft_steps"] == 3
    assert a["baseline_test_correctness"] == a["initial_test_correctness"]  # GRPO's step 0 is SFT's result
    rows = [r for r in read_jsonl(d / "sft" / "metrics" / "metrics.jsonl") if "sft/tokens" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # 16 episodes of 1-3 turns: 2 tokens a turn in the loss; the ~90-token prompt and the
        tokens = r["sft/tokens"]  # observations ("higher", "lower", ...) are not
        assert tokens % 2 == 0 and 2 * 16 <= tokens <= 6 * 16, r
    assert rows[-1]["sft/nll_per_token"] < rows[0]["sft/nll_per_token"]


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_every_trajectory_is_one_sequence_with_masked_observations(run):
    _, _, _, trajs = run
    assert len(trajs) >= 3 * 16
    _check_episodes(trajs)


def _check_episodes(trajs: list) -> None:
    tok = build_tokenizer()
    multi = 0
    for t in trajs:
        mask, lps = t.action_mask.tolist(), t.behavior_logprobs.tolist()
        runs = _runs(mask)
        assert runs[0][0] == 1 and runs[-1][0] == 1, (t.id, runs)  # begins and ends with the policy's turn
        assert t.terminal_reason in TERMINAL_REASONS and t.grader_version == "env:guess_number"
        assert set(t.reward_components) == {"env"} and t.reward in (0.0, 1.0)
        assert sum(e - s for s, e, *_ in t.segments) == len(mask) and t.segments[0][0] == 0
        turns = [r for r in runs if r[0] == 1]
        assert len(turns) <= 3 and all(e - s <= 6 for _, s, e in turns)
        for value, s, e in runs:
            if value == 0:  # an observation: the template's separators around the environment's text
                text = tok.decode(t.response_tokens[s:e].tolist())
                assert text.startswith(("</s>\nU: ", "\nU: ")) and text.endswith("\nA: "), text
                assert any(f in text for f in FEEDBACK), text
                assert set(lps[s:e]) == {0.0}
            else:
                assert all(x < 0 or x == 0.0 for x in lps[s:e])
        multi += len(turns) > 1
    assert multi > 0, "no episode had a second turn"


def test_the_env_metrics_are_logged(run):
    d, _, _, _ = run
    steps = [m for m in read_jsonl(d / "metrics" / "metrics.jsonl") if "learn/loss" in m]
    assert len(steps) == 3
    for m in steps:
        assert m["env/episodes"] == 16 and m["env/env_errors"] == 0
        assert sum(m[f"env/terminal/{r}"] for r in TERMINAL_REASONS) == pytest.approx(1.0)
        assert {"env/turns_mean", "env/step_seconds/p99", "learn/reward_env"} <= set(m)
    assert max(m["env/turns_mean"] for m in steps) > 1


def test_the_report_draws_the_env_panel(run):
    from megatron_rl.panels import CHARTS
    from megatron_rl.report import write_report

    d, _, _, _ = run
    drawn = {p.rsplit("/", 1)[-1] for p in write_report(d)["plots"]}
    assert {f"{c.slug}.png" for c in CHARTS if c.feature == "env/"} <= drawn


def test_dynamic_sampling_kept_the_groups_whose_rewards_vary(run):
    d, _, _, trajs = run
    reward = {t.id: t.reward for t in trajs}
    steps = {m["step"]: m for m in read_jsonl(d / "metrics" / "metrics.jsonl") if "learn/loss" in m}
    discarded = 0.0
    for row in read_jsonl(d / "consumed.jsonl"):
        groups: dict = {}
        for i in row["ids"]:
            groups.setdefault(i.rsplit("/", 1)[0], []).append(reward[i])
        m = steps[row["step"]]
        varying = sum(len(set(rewards)) > 1 for rewards in groups.values())
        assert len(groups) == 4 and varying == 4 - m["system/dynamic_filled_groups"], (row["step"], groups)
        assert 0 < m["system/dynamic_kept_fraction"] <= 1 or m["system/dynamic_filled_groups"] == 4
        discarded += m["system/dynamic_discarded_tokens"]
    assert discarded > 0, "no group was discarded: the filter was not exercised"


def test_the_round_engine_trains_on_episodes(rounds):
    d, out, trajs = rounds
    assert (out["steps"], out["version"]) == (2, 2)
    consumed = [i for row in read_jsonl(d / "consumed.jsonl") for i in row["ids"]]
    assert len(consumed) == 2 * 16 and len(set(consumed)) == len(consumed) and len(trajs) == 2 * 16
    _check_episodes(trajs)
    steps = [m for m in read_jsonl(d / "metrics" / "metrics.jsonl") if "learn/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["env/episodes"] == 16 and m["env/env_errors"] == 0 and m["env/dropped_groups"] == 0
        assert sum(m[f"env/terminal/{r}"] for r in TERMINAL_REASONS) == pytest.approx(1.0)
    for t in trajs:  # sync rounds: every turn sampled by the version the round was admitted at
        assert set(t.policy_versions.tolist()) == {int(t.id[1:7])}, t.id
