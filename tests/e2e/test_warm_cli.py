"""The warm CLI runs of the e2e tier (tests/e2e/warm_cli.py) behave as fresh `python -m megatron_rl.cli` runs do:
the caller's environment, directory, arguments and stdio; exit codes, tracebacks, signals; a killed client's
run dies with it.  A test double (tests/e2e/warm_probe.py) is the entry the child runs, so no training run is
needed; the last test compares a real command's output, warm and fresh.

    python -m pytest tests/e2e/test_warm_cli.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.conftest import REPO, cli_command
from tests.e2e.warm_cli import ENTRY_ENV, Servers

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def probe():
    """Runs the probe through one warm server of this module (started with a variable its runs do not have)."""
    servers = Servers(REPO)
    base = dict(os.environ, WARM_PROBE_SERVER_ONLY="the server's", PYTHONUNBUFFERED="1")
    servers.command((), base)  # start it with that environment

    def run(*args, env=None, cwd=REPO, **kwargs):
        run_env = {k: v for k, v in base.items() if k != "WARM_PROBE_SERVER_ONLY"}
        cmd, run_env = servers.command(args, dict(run_env, **(env or {}), **{ENTRY_ENV: "tests.e2e.warm_probe:main"}))
        return cmd, run_env, cwd

    yield run
    servers.stop()


def _run(spec, *, input_text="", timeout=60):
    cmd, env, cwd = spec
    return subprocess.run(cmd, env=env, cwd=cwd, input=input_text, capture_output=True, text=True, timeout=timeout)


def test_a_run_has_the_callers_environment_directory_arguments_and_stdio(probe, tmp_path):
    done = _run(probe("report", "x y", env={"WARM_PROBE": "the client's"}, cwd=tmp_path), input_text="from stdin")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["argv"] == ["report", "x y"] and seen["cwd"] == str(tmp_path) and seen["stdin"] == "from stdin"
    assert seen["probe"] == "the client's"
    assert seen["server_only"] is None  # the server's own variables are not the run's
    assert seen["main"] == "tests.e2e.warm_probe"  # what a spawned helper would import as its main
    assert done.stderr == "to stderr\n"


@pytest.mark.parametrize("args, code, stderr", [
    (("exit", "3"), 3, ""),
    (("system-exit", "a message"), 1, "a message\n"),
    (("raise",), 1, "ValueError: the probe's bug"),
])
def test_exit_codes_and_errors_are_a_fresh_pythons(probe, args, code, stderr):
    done = _run(probe(*args))
    assert done.returncode == code
    assert stderr in done.stderr
    if args[0] == "raise":
        assert "Traceback (most recent call last)" in done.stderr


def test_threads_are_joined_and_atexit_runs_before_the_exit(probe):
    done = _run(probe("finalise"))
    assert done.returncode == 0
    assert done.stdout.splitlines() == ["thread finished", "atexit ran"]


def _wait_for_pid(path, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError("the probe did not start")


def _gone(pid, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("handle", [False, True])
def test_a_signal_to_the_client_reaches_the_run_and_its_status_comes_back(probe, tmp_path, handle):
    cmd, env, cwd = probe("wait", str(tmp_path / "pid"), *(["handle"] if handle else []))
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, text=True)
    child = _wait_for_pid(tmp_path / "pid")
    assert child != proc.pid
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    if handle:
        assert (proc.returncode, out) == (7, "got SIGTERM\n")
    else:
        assert proc.returncode == -signal.SIGTERM  # killed by the signal, as a fresh Python would be
    assert _gone(child)


def test_a_killed_client_takes_its_run_with_it(probe, tmp_path):
    cmd, env, cwd = probe("wait", str(tmp_path / "pid"))
    proc = subprocess.Popen(cmd, env=env, cwd=cwd)
    child = _wait_for_pid(tmp_path / "pid")
    proc.kill()
    proc.wait(timeout=10)
    assert _gone(child), "the run outlived its killed client"


def test_a_real_command_says_the_same_warm_and_fresh(tmp_path):
    """megatron-rl's own error path, through the suite's warm server and through a fresh Python."""
    args = ("train", "--config", str(REPO / "configs" / "tiny_cpu_scratch.yaml"), "no_such_section.x=1")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    warm_cmd, warm_env = cli_command(args, env)
    assert warm_cmd[:3] == [sys.executable, "-S", str(REPO / "tests" / "e2e" / "warm_cli.py")]
    warm = subprocess.run(warm_cmd, env=warm_env, cwd=REPO, capture_output=True, text=True, timeout=300)
    fresh = subprocess.run([sys.executable, "-m", "megatron_rl.cli", *args], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert warm.returncode == 2 and "unknown config key 'no_such_section'" in warm.stderr
