"""Run directories that survive damage (issue 44, part 6): every command that reads one answers damaged input
with one line naming the file and what is wrong, exit 2, no traceback, and nothing on disk changed; a bad line
of metrics.jsonl is skipped and counted, never a blocked resume; --force never deletes a file; a LoRA rank the
engines cannot serve is refused at dry run.

    python -m pytest tests/unit/test_damaged_run_dirs.py -q

Each case drives the real CLI entry point in-process (megatron_rl.cli.main) on a run directory damaged by
hand: no Ray, vLLM or Megatron starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import re
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from megatron_rl.cli import main

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SCRATCH = REPO / "configs" / "tiny_cpu_scratch.yaml"
LORA = REPO / "configs" / "tiny_cpu_lora.yaml"
BAD_LINE = "1 unreadable line(s) skipped"


def metrics_bytes(steps: int = 3, final_eval: bool = False) -> bytes:
    rows = [{"step": s, "time": 1.0, "learn/reward_mean": 0.1 * s} for s in range(1, steps + 1)]
    if final_eval:
        rows.append({"step": steps, "time": 2.0, "eval/test_reward": 0.7, "eval/test_correctness": 0.2,
                     "eval/test_format": 1.0})
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def with_bad_byte(data: bytes) -> bytes:
    """One byte of the second line replaced by one that is not UTF-8."""
    at = data.index(b"\n") + 5
    return data[:at] + b"\xff" + data[at + 1:]


def make_run(tmp_path: Path, *overrides: str) -> Path:
    """A run directory as `train` leaves it before its first step: its resolved config and a metrics log."""
    from megatron_rl.train.config import load_train_config, resolved_dict

    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    cfg = load_train_config(SCRATCH, [f"run.dir={run}", *overrides])
    (run / "config.json").write_text(json.dumps(resolved_dict(cfg)))
    (run / "metrics" / "metrics.jsonl").write_bytes(metrics_bytes())
    return run


def trajectory(tid: str, segments):
    """A trajectory of 12 response tokens whose response spans versions 0 and 1 as `segments` say."""
    from megatron_rl.trajectory import make_trajectory

    versions = np.zeros(12, np.int32)
    versions[4:] = 1
    traj = make_trajectory(id=tid, prompt_id="p", dataset_version="d", tokenizer_hash="t", grader_version="g",
                           terminal_reason="length", rollout_started_at=0.0, scored_at=1.0, policy_versions=versions,
                           prompt_tokens=[1, 2, 3], response_tokens=list(range(12)),
                           behavior_logprobs=-np.ones(12, np.float32), reward_components={"correct": 1.0})
    traj = dataclasses.replace(traj, segments=segments)
    return dataclasses.replace(traj, checksum=traj.compute_checksum())


def queue_log(path: Path, trajs=(), rows: int = 0) -> None:
    """The coordinator's log as far as the audit reads it: the traj table's payloads."""
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE traj (seq INTEGER PRIMARY KEY, id TEXT, payload BLOB)")
        db.executemany("INSERT INTO traj (id, payload) VALUES (?, ?)", [(t.id, t.to_bytes()) for t in trajs])
        db.executemany("INSERT INTO traj (id, payload) VALUES (?, ?)", [(str(i), bytes([i % 251]) * 3000)
                                                                        for i in range(rows)])
    db.close()


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def refused(capsys, argv: list[str], *named: str, root: Path | None = None) -> str:
    """Run the CLI: exit 2 with exactly one console line, `megatron-rl CMD: error: ...` naming each of `named`;
    no traceback, nothing else printed; every file under `root` still there, byte for byte."""
    before = snapshot(root) if root is not None else None
    code = main(argv)
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert code == 2, (code, lines)
    assert len(lines) == 1 and lines[0].startswith(f"megatron-rl {argv[0]}: error: "), lines
    assert "Traceback" not in out.err
    for name in named:
        assert name in lines[0], (name, lines[0])
    if root is not None:
        after = snapshot(root)
        assert {k: after.get(k) for k in before} == before
    return lines[0]


# --- audit -----------------------------------------------------------------------------------------------------

def test_audit_of_a_config_json_that_is_not_utf8(tmp_path, capsys):
    run = make_run(tmp_path)
    (run / "config.json").write_bytes(b'{"run": "\xff\xfe"}')
    line = refused(capsys, ["audit", str(run)], str(run / "config.json"), "not UTF-8", root=tmp_path)
    assert "0xff" in line


@pytest.mark.parametrize("config", [{"run": {"steps": 3}}, {"model": {"tiny": True}, "learner": {"lr": "fast"}}, [1]])
def test_audit_of_a_config_json_that_is_not_a_run_config(tmp_path, capsys, config):
    run = make_run(tmp_path)
    (run / "config.json").write_text(json.dumps(config))
    refused(capsys, ["audit", str(run)], str(run / "config.json"), root=tmp_path)


def test_audit_of_a_queue_log_that_is_not_a_database(tmp_path, capsys):
    run = make_run(tmp_path)
    (run / "queue.db").write_bytes(bytes(range(256)) * 16)
    refused(capsys, ["audit", str(run)], str(run / "queue.db"), "file is not a database", root=tmp_path)


def test_audit_of_a_truncated_queue_log(tmp_path, capsys):
    run = make_run(tmp_path)
    queue_log(run / "queue.db", rows=200)
    data = (run / "queue.db").read_bytes()
    (run / "queue.db").write_bytes(data[:len(data) // 2])
    refused(capsys, ["audit", str(run)], str(run / "queue.db"), "malformed", root=tmp_path)


@pytest.mark.parametrize("segments", [[[0, 4, 0, 0], [4, 12, "one", 1]], "garbage", [[0, 12, 1, 1, 9]]])
def test_audit_of_a_trajectory_with_malformed_segments(tmp_path, capsys, segments):
    run = make_run(tmp_path)
    queue_log(run / "queue.db", [trajectory("t-1", [[0, 4, 0, 0], [4, 12, 1, 1]]), trajectory("t-2", segments)])
    refused(capsys, ["audit", str(run)], str(run / "queue.db"), "'t-2'", "segments", root=tmp_path)


@pytest.mark.parametrize("garbage", [b"\x00garbage{", b"\xff\xfe", b"[1, 2]"])
def test_audit_of_a_garbage_run_manifest(tmp_path, capsys, garbage):
    run = make_run(tmp_path)
    queue_log(run / "queue.db", [trajectory("t-1", [[0, 4, 0, 0], [4, 12, 1, 1]])])
    (run / "run_manifest.json").write_bytes(garbage)
    refused(capsys, ["audit", str(run)], str(run / "run_manifest.json"), root=tmp_path)


@pytest.mark.parametrize("option", [["--sequences", "-1"], ["--sequences", "0"], ["--tolerance", "nan"]])
def test_audit_refuses_an_option_out_of_range(tmp_path, capsys, option):
    run = make_run(tmp_path)
    refused(capsys, ["audit", str(run), *option], option[0], root=tmp_path)


# --- eval, doctor, report --------------------------------------------------------------------------------------

def test_eval_of_a_run_whose_config_json_is_binary(tmp_path, capsys):
    run = make_run(tmp_path)
    (run / "config.json").write_bytes(bytes(range(256)))
    refused(capsys, ["eval", "--run", str(run)], str(run / "config.json"), root=tmp_path)


def test_doctor_skips_and_counts_a_metrics_line_that_is_not_utf8(tmp_path, capsys):
    run = make_run(tmp_path)
    (run / "metrics" / "metrics.jsonl").write_bytes(with_bad_byte(metrics_bytes()))
    before = snapshot(tmp_path)
    assert main(["doctor", str(run), "--json"]) in (0, 1)
    out = capsys.readouterr()
    assert json.loads(out.out)["steps"] == 2  # steps 1 and 3: the damaged line of step 2 is skipped
    assert BAD_LINE in out.err and "line 2" in out.err and "Traceback" not in out.err
    assert snapshot(tmp_path) == before


def test_doctor_of_a_run_whose_config_json_is_damaged(tmp_path, capsys):
    run = make_run(tmp_path)
    (run / "config.json").write_bytes(b'{"run": {"steps": 3')
    refused(capsys, ["doctor", str(run)], str(run / "config.json"), "not valid JSON", root=tmp_path)


def test_report_skips_and_counts_a_metrics_line_that_is_not_utf8(tmp_path, capsys):
    run = make_run(tmp_path)
    (run / "metrics" / "metrics.jsonl").write_bytes(with_bad_byte(metrics_bytes()))
    (run / "run_manifest.json").write_bytes(b"\xff")
    before = snapshot(tmp_path)
    assert main(["report", str(run), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["steps"] == 2
    assert BAD_LINE in out.err and "Traceback" not in out.err
    after = snapshot(tmp_path)
    assert {k: after[k] for k in before} == before
    assert "not recorded (run_manifest.json cannot be read)" in (run / "report" / "summary.md").read_text()


# --- experiment and train configs ------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["experiment", "train"])
def test_a_malformed_yaml_config_is_one_line(tmp_path, capsys, command):
    path = tmp_path / "bad.yaml"
    path.write_text("a: [1, 2\nb: {\n")
    line = refused(capsys, [command, "--config", str(path)], str(path), "not valid YAML", "line 2 column 2",
                   root=tmp_path)
    assert "^" not in line


def test_experiment_config_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"dir: \xff\n")
    refused(capsys, ["experiment", "--config", str(path)], str(path), "not UTF-8", root=tmp_path)


# --- resume ----------------------------------------------------------------------------------------------------

def test_a_bad_metrics_byte_does_not_block_a_resume(tmp_path, capsys):
    """A finished run started again: the resume reads metrics.jsonl for its final test eval first thing."""
    from megatron_rl.checkpoint import save_checkpoint

    run = make_run(tmp_path, "run.steps=3")

    def save_fn(tmp):
        (tmp / "weights").mkdir()
        (tmp / "weights" / "w.bin").write_bytes(b"w")

    save_checkpoint(run / "checkpoints", 3, policy_version=3, config_hash="x", save_fn=save_fn)
    (run / "metrics" / "metrics.jsonl").write_bytes(with_bad_byte(metrics_bytes(final_eval=True)))
    assert main(["train", "--config", str(SCRATCH), f"run.dir={run}", "run.steps=3"]) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out.splitlines()[-1])
    assert summary["already_done"] and summary["final_test_reward"] == 0.7
    assert BAD_LINE in out.err and "Traceback" not in out.err


def test_rewind_restore_and_test_evals_skip_bad_lines_and_the_log_goes_on(tmp_path, caplog):
    """What a resume does with metrics.jsonl (reporting/reporter.py Reporter.rewind): rewind to the checkpoint's
    step, count the generated tokens kept (stop.max_generated_tokens), read back the test evals; then log."""
    from megatron_rl.metrics import MetricsLogger, logged_test_evals
    from megatron_rl.reporting.stop import StopConfig, StopRules

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "time": 1.0, "system/generated_tokens": 10.0} for s in range(1, 5)]
    rows.insert(2, {"step": 2, "time": 1.0, "eval/test_reward": 0.5, "eval/test_correctness": 0.5,
                    "eval/test_format": 1.0})
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()  # line 2 (step 2's tokens) gets the bad byte
    path.write_bytes(with_bad_byte(data) + b"[1, 2]\n" + b'{"step": 5, "system/gen')  # not a record; torn
    with caplog.at_level(logging.WARNING, logger="megatron_rl"):
        assert StopRules(StopConfig()).restore(path) == 30.0  # steps 1, 3 and 4, before the rewind
        with MetricsLogger(tmp_path, tensorboard=False) as log:
            log.rewind(3)
            log.log(4, {"learn/loss": 1.0})
        assert log.failures == {}
        assert logged_test_evals(path) == {2: {"reward": 0.5, "correctness": 0.5, "format": 1.0}}
        rules = StopRules(StopConfig(max_generated_tokens=20))
        assert rules.restore(path) == 20.0 and rules.budget_spent()  # steps 1 and 3: the budget stays spent
    kept = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in kept] == [1, 2, 3, 4] and kept[-1] == {"step": 4, "time": kept[-1]["time"],
                                                                       "learn/loss": 1.0}
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "3 unreadable line(s) skipped" in warned and "dropped by the resume's rewind" in warned


# --- convert --force -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_mcore(tmp_path_factory):
    from megatron_rl.conversion.hf_to_mcore import convert_hf_to_mcore
    from megatron_rl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    hf = make_tiny_model(root / "hf", arch="llama", seed=0)
    return hf, convert_hf_to_mcore(hf, root / "mcore")


@pytest.mark.parametrize("what", ["mcore-to-hf", "hf-to-mcore", "lora-export"])
def test_force_never_deletes_a_regular_file(tmp_path, capsys, tiny_mcore, what):
    hf, mcore = tiny_mcore
    out = tmp_path / "keep.bin"
    out.write_bytes(b"not an output directory")
    source = ["--hf", str(hf)] if what == "hf-to-mcore" else ["--mcore", str(mcore)]
    if what == "lora-export":  # the refusal comes before the checkpoint is even read
        source = ["--mcore", str(tmp_path / "no-such-checkpoint")]
    refused(capsys, ["convert", what, *source, "--out", str(out), "--force"], str(out), "not a directory",
            root=tmp_path)
    assert out.read_bytes() == b"not an output directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.bin"]  # no partial output left either


def test_force_still_replaces_an_output_directory(tmp_path, capsys, tiny_mcore):
    hf, mcore = tiny_mcore
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("old")
    assert main(["convert", "mcore-to-hf", "--mcore", str(mcore), "--out", str(out), "--force"]) == 0
    capsys.readouterr()
    assert (out / "config.json").is_file() and not (out / "old.txt").exists()


# --- LoRA rank -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["train", "plan"])
def test_a_lora_rank_vllm_cannot_serve_is_refused_at_dry_run(tmp_path, capsys, command):
    run = tmp_path / "run"
    argv = [command, "--config", str(LORA), *(["--dry-run"] if command == "train" else []),
            "learner.lora.rank=1024", f"run.dir={run}"]
    refused(capsys, argv, "learner.lora.rank 1024", "512")
    assert not run.exists()


def test_the_largest_rank_vllm_serves_passes(tmp_path, capsys):
    assert main(["plan", "--config", str(LORA), "learner.lora.rank=512", "--json"]) == 0
    capsys.readouterr()


def test_the_rank_limit_is_the_installed_vllms():
    """The ranks vLLM's LoRAConfig takes (read from its source: importing vLLM is slow)."""
    from megatron_rl.models.lora import VLLM_LORA_RANKS

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    source = Path(list(spec.submodule_search_locations)[0], "config", "lora.py")
    if not source.is_file():
        pytest.skip(f"{source} not found: vLLM's layout changed")
    match = re.search(r"MaxLoRARanks\s*=\s*Literal\[([^\]]*)\]", source.read_text())
    assert match, f"{source} has no MaxLoRARanks"
    assert tuple(int(x) for x in match.group(1).split(",")) == VLLM_LORA_RANKS
