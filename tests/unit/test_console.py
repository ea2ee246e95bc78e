"""The quiet console: progress and the project's messages on the terminal, library logs in RUN_DIR/logs.

    python -m pytest tests/unit/test_console.py -q

The fd-level checks run in a child process (what C libraries and child processes write goes to
file descriptor 2, which pytest itself captures in this process).
"""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.console import PROGRESS_LOGGER, ConsoleHandler

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _record(name: str, level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_console_shows_progress_and_project_messages_but_not_library_chatter():
    out = io.StringIO()
    h = ConsoleHandler(out, verbose=False, bar=False)
    for name, level, msg in [(PROGRESS_LOGGER, logging.INFO, "step 1/2"), ("vllm.engine", logging.WARNING, "chatty"),
                             ("megatron.core", logging.INFO, "chatty too"), ("ray", logging.WARNING, "ray chatter"),
                             ("megatron_rl.train.checkpointing", logging.INFO, "checkpoint committed"),
                             ("vllm.engine", logging.ERROR, "engine died"), (PROGRESS_LOGGER, logging.INFO, "step 2/2")]:
        h.handle(_record(name, level, msg))
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 1/2" and lines[-1] == "step 2/2"
    assert len(lines) == 4 and "checkpoint committed" in lines[1] and "engine died" in lines[2]
    verbose = io.StringIO()
    ConsoleHandler(verbose, verbose=True, bar=False).handle(_record("vllm.engine", logging.WARNING, "chatty"))
    assert "chatty" in verbose.getvalue()


def test_piped_progress_of_a_long_run_shows_about_ten_lines():
    from megatron_rl.console import progress_due

    out = io.StringIO()
    h = ConsoleHandler(out, verbose=False, bar=False)
    for step in range(1, 101):
        rec = _record(PROGRESS_LOGGER, logging.INFO, f"step {step}/100")
        rec.progress_step, rec.progress_total = step, 100
        h.handle(rec)
    lines = out.getvalue().splitlines()
    assert lines == ["step 1/100"] + [f"step {s}/100" for s in range(10, 101, 10)]
    assert all(progress_due(s, 8) for s in range(1, 9))  # a short run shows every step
    assert [s for s in range(1, 24) if progress_due(s, 23)] == [1, 3, 6, 9, 12, 15, 18, 21, 23]


def test_on_a_terminal_progress_is_one_bar_redrawn_in_place():
    out = io.StringIO()
    h = ConsoleHandler(out, verbose=False, bar=True)
    h.handle(_record(PROGRESS_LOGGER, logging.INFO, "step 1/3"))
    h.handle(_record(PROGRESS_LOGGER, logging.INFO, "step 2/3"))
    h.handle(_record("megatron_rl.x", logging.WARNING, "a warning"))
    h.handle(_record(PROGRESS_LOGGER, logging.INFO, "step 3/3"))
    h.end_bar()
    text = out.getvalue()
    assert text.count("\n") == 2  # the warning's line and the finished bar: the steps share one line
    screen = text.split("\n")
    assert "a warning" in screen[0] and screen[1].endswith("step 3/3")
    assert "\r\x1b[K" in text


CHILD = textwrap.dedent("""
    import logging, os, subprocess, sys, warnings
    from megatron_rl.console import console_session, progress
    run_dir = sys.argv[1]
    with console_session(verbose=sys.argv[2] == "1") as console:
        logging.getLogger("vllm").warning("before the run dir: kept for the log file")
        console.attach_run_dir(run_dir)
        logging.getLogger("megatron.core").warning("a library warning")
        warnings.warn("a python warning")
        os.write(2, b"C++ library writes to fd 2\\n")
        sys.stderr.write("a library progress bar on sys.stderr\\n")
        subprocess.run(["sh", "-c", "echo child engine process >&2"], check=True)
        progress("step 1/1 | reward 0.5")
        logging.getLogger("megatron_rl.train").info("eval done")
        logging.getLogger("ray").error("an error reaches the console")
        console.worker_output({"pid": 42, "ip": "10.0.0.1", "actor_name": "RolloutWorker",
                               "lines": ["INFO vllm engine started", "ERROR 11-30 boom in the engine",
                                         "INFO megatron_rl.rollout.worker: engine ready",
                                         "WARNING megatron_rl.coordinator.queue: backpressure on (d_lag_p95)"]})
    sys.stderr.write("after the session: console again\\n")
    os.write(2, b"fd 2 restored\\n")
""")


def _child(tmp_path: Path, verbose: bool) -> tuple[list[str], Path]:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), "1" if verbose else "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr.splitlines(), tmp_path / "logs"


def test_library_logs_and_fd2_go_to_the_run_dir_errors_reach_the_console(tmp_path):
    console, logs = _child(tmp_path, verbose=False)
    text = "\n".join(console)
    for shown in ("step 1/1 | reward 0.5", "eval done", "an error reaches the console", "boom in the engine",
                  "WARNING megatron_rl.coordinator.queue: (RolloutWorker (pid=42, 10.0.0.1)) backpressure on (d_lag_p95)",
                  "after the session: console again", "fd 2 restored"):
        assert shown in text, shown
    for hidden in ("a library warning", "a python warning", "C++ library", "child engine process", "progress bar",
                   "before the run dir", "vllm engine started", "engine ready"):
        assert hidden not in text, hidden
    assert len(console) == 7, console
    driver = (logs / "driver.log").read_text()
    for kept in ("before the run dir", "a library warning", "a python warning", "C++ library writes to fd 2",
                 "a library progress bar on sys.stderr",
                 "child engine process", "an error reaches the console"):
        assert kept in driver, kept
    worker = (logs / "ray_RolloutWorker.log").read_text().splitlines()
    assert worker[:2] == ["(pid=42, 10.0.0.1) INFO vllm engine started", "(pid=42, 10.0.0.1) ERROR 11-30 boom in the engine"]
    assert len(worker) == 4 and worker[2].endswith("INFO megatron_rl.rollout.worker: engine ready")


def test_verbose_shows_library_logs_on_the_console(tmp_path):
    console, logs = _child(tmp_path, verbose=True)
    text = "\n".join(console)
    for shown in ("a library warning", "C++ library writes to fd 2", "child engine process", "step 1/1"):
        assert shown in text, shown
    assert "a library warning" in (logs / "driver.log").read_text()  # the file is written either way


def test_user_errors_exit_2_in_one_line_bugs_propagate(capsys, monkeypatch, tmp_path):
    import megatron_rl.report as report

    tiny = str(REPO / "configs" / "tiny_cpu.yaml")
    # A section's own check (__post_init__ ValueError) is input the user can fix: one line naming it.
    assert main(["train", "--dry-run", "--config", tiny, "reward.num_workers=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reward: num_workers must be >= 1" in err[0]

    def bug(*_a, **_k):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(report, "write_report", bug)
    with pytest.raises(ValueError, match="an internal invariant broke"):  # not "bad input": a traceback, exit 1
        main(["report", str(tmp_path)])


def test_verbose_is_accepted_after_the_subcommand(capsys):
    tiny = str(REPO / "configs" / "tiny_cpu.yaml")
    # argparse would refuse an unknown option after `train` (exit 2); the CLI takes it anywhere.
    assert main(["train", "--config", tiny, "--dry-run", "--verbose", "run.steps=3"]) == 0
    assert main(["--verbose", "train", "--config", tiny, "--dry-run", "run.steps=3"]) == 0


def test_the_parser_imports_no_heavy_library():
    """`megatron-rl --help` and a command's argument errors answer at once: building the parser of every
    subcommand imports none of torch, Ray, vLLM or Megatron (cli.py: heavy imports live in the command
    functions; the config modules they pass through are pure Python).  It took 2 s when the platform,
    learner and LoRA packages imported torch with their config."""
    code = ("import sys; from megatron_rl.cli import build_parser; build_parser(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray', 'vllm', 'megatron'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
