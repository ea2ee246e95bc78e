"""The python environment's sandbox (issue 28): an infinite loop, a fork bomb, a large allocation, a
network call, a flood of output and a sleeper each end within their limit as a clear observation.

    python -m pytest tests/unit/test_env_sandbox.py -q
"""

from __future__ import annotations

import json

import pytest

from megatron_rl.envs.example import Example
from megatron_rl.envs.protocol import EnvError
from megatron_rl.envs.python_tool import PythonConfig, PythonEnvironment
from megatron_rl.envs.sandbox import Sandbox, SandboxConfig, SandboxError, namespaces_available

# wall-clock room for 1 CPU second on a loaded 2-core machine; the sleeper gets its own short wall limit
LIMITS = dict(cpu_seconds=1, wall_seconds=10.0, memory_mb=256, output_bytes=1000)
SHORT_WALL = 1.5


def _call(code: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def env():
    env = PythonEnvironment(PythonConfig(sandbox=SandboxConfig(**LIMITS)))
    env.reset(Example(id="p", question="What is 6 * 7?", answer="42"))
    return env


def _observe(env, code: str):
    result = env.step(_call(code))
    assert not result.done and result.reward is None
    return result


def test_code_runs_in_a_scratch_directory_and_is_scored_from_the_answer(env):
    result = _observe(env, "import os\nopen('note.txt', 'w').write('hi')\nprint(6 * 7, sorted(os.listdir('.')))")
    assert result.observation == "42 ['note.txt']\n[exit code 0]"  # the code itself is read-only, elsewhere
    assert result.info["tool_calls"] == 1 and result.info["tool_errors"] == 0
    assert "note.txt" not in _observe(env, "import os; print(os.listdir('.'))").observation  # fresh each run
    final = env.step("Answer: 42")
    assert final.done and final.reward == 1.0
    env.reset(Example(id="p", question="What is 6 * 7?", answer="42"))


@pytest.mark.parametrize("code, expected", [
    ("while True:\n    pass", "[killed: CPU time limit of 1 s]"),
    # the fork bombs are bounded (children do not fork again; at most 50 sleepers), so a sandbox that
    # failed to refuse them would fail this test without taking the shared machine down
    ("import os, time\nfor _ in range(50):\n    if os.fork() == 0:\n        time.sleep(3)\n        os._exit(0)",
     "PermissionError: os.fork is not allowed in the sandbox"),
    ("import subprocess\nsubprocess.run(['sh', '-c', 'for i in 1 2 3; do sleep 3 & done'])",
     "PermissionError: subprocess.Popen is not"),
    ("x = bytearray(2 * 1024 ** 3)", "MemoryError"),
    ("import urllib.request\nurllib.request.urlopen('http://1.1.1.1', timeout=2)", "is not allowed in the sandbox"),
    ("while True:\n    print('y' * 100)", "[killed: output passed 8000 bytes]"),
    ("import time\ntime.sleep(30)", f"[killed: wall-clock limit of {SHORT_WALL:g} s]"),
    ("def broken(:\n    pass", "SyntaxError"),
], ids=["infinite_loop", "fork_bomb", "shell_fork_bomb", "large_allocation", "network", "output_flood", "sleeper",
        "syntax_error"])
def test_each_limit_ends_as_a_clear_observation_within_its_limit(env, code, expected):
    wall = SHORT_WALL if "sleep" in code else LIMITS["wall_seconds"]
    if "sleep" in code:
        env = PythonEnvironment(PythonConfig(sandbox=SandboxConfig(**dict(LIMITS, wall_seconds=SHORT_WALL))))
        env.reset(Example(id="p", question="?", answer="1"))
    result = _observe(env, code)
    assert expected in result.observation, result.observation
    assert result.info["tool_errors"] == 1
    assert result.info["tool_seconds"] < wall + 1.0
    assert "sandbox_child" not in result.observation  # the sandbox's own frames are not shown
    assert len(result.observation) < LIMITS["output_bytes"] + 200


@pytest.mark.skipif(not namespaces_available(), reason="unshare cannot create user/network namespaces here")
def test_the_network_namespace_has_no_interface_but_loopback():
    box = Sandbox(SandboxConfig(**LIMITS, isolation="weak", network_isolation="namespace"))
    assert box.isolation == "weak:namespace"
    run = box.run("print(open('/proc/net/dev').read())")
    interfaces = [line.split(":")[0].strip() for line in run.output.splitlines() if ":" in line]
    assert run.exit_code == 0 and interfaces == ["lo"], run.output


def test_malformed_calls_are_observations_and_a_broken_sandbox_is_env_error(env):
    result = env.step("<tool_call>{\"name\": \"python\"</tool_call>")
    assert result.observation.startswith("Malformed tool call: tool call 1 is not valid JSON")
    result = env.step(_call("print(1)") + _call("print(2)"))
    assert "2 tool calls; make exactly one per turn" in result.observation
    result = env.step('<tool_call>{"name": "python", "arguments": {"source": "print(1)"}}</tool_call>')
    assert "with a \"code\" string argument" in result.observation
    with pytest.raises(EnvError, match="sandbox.python 'no-such-python' is not an executable"):
        PythonEnvironment(PythonConfig(sandbox=SandboxConfig(**LIMITS, python="no-such-python")))
    with pytest.raises(ValueError, match="sandbox.cpu_seconds must be an int >= 1"):
        SandboxConfig(cpu_seconds=0)
    if not namespaces_available():
        with pytest.raises(SandboxError, match="network_isolation is 'namespace'"):
            Sandbox(SandboxConfig(isolation="weak", network_isolation="namespace"))
    with pytest.raises(ValueError, match="sandbox.isolation must be one of bwrap, service, weak, got 'docker'"):
        SandboxConfig(isolation="docker")
    with pytest.raises(ValueError, match="needs sandbox.service_url"):
        SandboxConfig(isolation="service")


def test_without_a_namespace_the_audit_hook_still_refuses_raw_sockets():
    box = Sandbox(SandboxConfig(**LIMITS, isolation="weak", network_isolation="audit_hook"))
    assert box.isolation == "weak:audit_hook"
    run = box.run("import _socket\ns = _socket.socket()\ns.settimeout(1)\ns.connect(('1.1.1.1', 80))")
    assert run.exit_code == 1 and "PermissionError: socket.__new__ is not allowed" in run.output, run.output


def test_a_step_past_the_episode_timeout_ends_with_timeout_and_kills_the_code():
    import threading
    import time

    from megatron_rl.envs.chat_format import ChatFormat
    from megatron_rl.envs.protocol import EpisodeLimits
    from megatron_rl.envs.runner import EpisodeRunner, run_episode
    from tests.unit.tiny_chat import tiny_chat_tokenizer

    tok = tiny_chat_tokenizer()
    env = PythonEnvironment(PythonConfig(sandbox=SandboxConfig(**LIMITS)))  # wall limit 10 s > step timeout
    runner = EpisodeRunner(env, ChatFormat(tok), EpisodeLimits(step_timeout_s=1.0))
    ids = tok(_call("import time\ntime.sleep(30)") + "<|im_end|>", add_special_tokens=False)["input_ids"]
    seen = {}

    def watch():  # the sandboxed process, as soon as it exists
        while True:
            proc = env.sandbox.running
            if proc is not None:
                seen["proc"] = proc
                return
            time.sleep(0.01)
    threading.Thread(target=watch, daemon=True).start()
    start = time.monotonic()
    ep = run_episode(runner, Example(id="p", question="?", answer="1"), lambda t, n: (ids, [-1.0] * len(ids), 0))
    assert ep.terminal_reason == "timeout" and "after 1 s" in ep.error
    assert time.monotonic() - start < 3.0
    seen["proc"].wait(timeout=2.0)  # killed by close(), not by its 10 s wall limit
    assert seen["proc"].returncode == -9


def test_a_run_on_a_node_without_bubblewrap_refuses_to_start_and_weak_is_recorded(tmp_path, monkeypatch, caplog):
    """EnvConfig.preflight (run_setup calls it before writing the run directory; the dry run shows it)."""
    from megatron_rl.config import ConfigError
    from megatron_rl.envs import bwrap
    from megatron_rl.envs.config import EnvConfig
    from megatron_rl.run_manifest import open_run

    assert EnvConfig(name="python").preflight() == {"sandbox": "bwrap"}
    assert EnvConfig(name="calculator").preflight() == {}
    with caplog.at_level("WARNING"):
        weak = EnvConfig(name="python", options={"sandbox": {"isolation": "weak"}}).preflight()
    assert weak["sandbox"].startswith("weak:") and "isolation is 'weak'" in caplog.text
    # the node's lack, injected: bubblewrap does not run here
    monkeypatch.setattr(bwrap, "probe", lambda python="": {"runs": False, "error": "bubblewrap (bwrap) is not "
                                                           "installed: apt-get install bubblewrap"})
    with pytest.raises(ConfigError, match=r"^data.env \(python\): sandbox.isolation is 'bwrap' but bubblewrap \(bwrap\) "
                                          r"is not installed.*sandbox.isolation: weak"):
        EnvConfig(name="python").preflight()
    manifest = open_run(tmp_path, kind="train", config_hash="h", resuming=False, environment=weak,
                        identity={"model": "m", "tokenizer_hash": "t", "dataset_version": "d", "grader_version": "g"})
    assert manifest["environment"] == weak and manifest["attempts"][-1]["environment"] == weak
