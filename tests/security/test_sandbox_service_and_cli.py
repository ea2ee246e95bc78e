"""The sandbox service backend (SandboxFusion's /run_code against a server this test starts) and the
`megatron-rl sandbox check | run` commands a cluster user runs on a compute node (issue 44 items 2-3).

    python -m pytest tests/security/test_sandbox_service_and_cli.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

import pytest

from megatron_rl.envs.example import Example
from megatron_rl.envs.python_tool import PythonConfig, PythonEnvironment
from megatron_rl.envs.sandbox import Sandbox, SandboxConfig, SandboxError
from megatron_rl.envs.sandbox_server import make_server

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "megatron_rl.cli"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("svc") / "token"
    token_file.write_text("a-long-random-token\n")
    srv = make_server(SandboxConfig(wall_seconds=3.0, memory_mb=256), token="a-long-random-token")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", str(token_file)
    srv.shutdown()
    srv.server_close()


def _post(url: str, payload, token: str | None = "a-long-random-token") -> tuple[int, dict]:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/run_code", data=data, headers=headers)) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_service_runs_code_in_its_sandbox_and_answers_in_sandboxfusions_shape(server):
    url, token_file = server
    status, answer = _post(url, {"code": "print(6 * 7)", "language": "python", "run_timeout": 2})
    assert status == 200 and answer["status"] == "Success"
    run = answer["run_result"]
    assert run["status"] == "Finished" and run["return_code"] == 0 and run["stdout"] == "42\n"
    status, answer = _post(url, {"code": "print(open('/etc/passwd').read())", "language": "python"})
    assert answer["status"] == "Failed" and "root:" not in answer["run_result"]["stdout"]
    assert answer["run_result"]["violations"] == ["read /etc/passwd"]


def test_a_request_lowers_the_servers_limits_but_never_raises_them(server):
    url, _ = server
    _, answer = _post(url, {"code": "import time; time.sleep(20)", "run_timeout": 600, "memory_limit_MB": 1 << 20})
    run = answer["run_result"]
    assert run["status"] == "TimeLimitExceeded" and run["execution_time"] < 3.0 + 2.0
    _, answer = _post(url, {"code": "import time; time.sleep(20)", "run_timeout": 0.5})
    assert answer["run_result"]["execution_time"] < 2.0
    _, answer = _post(url, {"code": "x = bytearray(400 << 20)", "memory_limit_MB": 10 ** 6})
    assert "MemoryError" in answer["run_result"]["stdout"]  # the server's 256 MiB, not the request's


def test_the_service_refuses_strangers_and_bad_requests(server):
    url, _ = server
    assert _post(url, {"code": "print(1)"}, token=None)[0] == 401
    assert _post(url, {"code": "print(1)"}, token="wrong")[0] == 401
    assert _post(url, b"not json")[0] == 400
    assert _post(url, {"code": "print(1)", "language": "bash"})[1]["status"] == "Failed"


def test_the_python_environment_over_the_service(server, tmp_path):
    url, token_file = server
    env = PythonEnvironment(PythonConfig(sandbox=SandboxConfig(isolation="service", service_url=url,
                                                               service_token_file=token_file, wall_seconds=3.0)))
    env.reset(Example(id="p", question="What is 6 * 7?", answer="42"))
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(open(\'/etc/passwd\').read())"}}\n</tool_call>'
    result = env.step(call)
    assert "root:" not in result.observation and "FileNotFoundError" in result.observation
    assert result.info["tool_errors"] == 1 and result.info["sandbox_violations"] == 1
    # an unreachable server or a wrong token is the sandbox's failure (env_error), never the code's zero
    bad = Sandbox(SandboxConfig(isolation="service", service_url="http://127.0.0.1:9", wall_seconds=1.0))
    with pytest.raises(SandboxError, match="sandbox service http://127.0.0.1:9/run_code failed"):
        bad.run("print(1)")
    with pytest.raises(SandboxError, match="answered HTTP 401"):
        Sandbox(SandboxConfig(isolation="service", service_url=url)).run("print(1)")


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=env or dict(os.environ))


def test_sandbox_run_reports_containment_of_the_issues_snippets(tmp_path):
    """The issue's acceptance, through the command a cluster user runs."""
    outside = Path(tempfile.mkdtemp(prefix="mrl-outside-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    outside.rmdir()  # the code tries to create it as a file
    snippets = {
        "passwd": "print(open('/etc/passwd').read())",
        "kill_parent": "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), 9)",
        "write_outside": f"open({str(outside)!r}, 'w').write('x')",
        "setsid_sleeper": ("import _posixsubprocess, os, time\nargs = [b'/bin/sh', b'-c', b'sleep 7.4321']\n"
                           "_posixsubprocess.fork_exec(args, args, True, (), None, None, -1, -1, -1, -1, -1, -1, "
                           "*os.pipe(), False, True, -1, None, None, -1, -1, None, False)\ntime.sleep(60)"),
    }
    for name, code in snippets.items():
        path = tmp_path / f"{name}.py"
        path.write_text(code)
        out = _cli("sandbox", "run", str(path), "--set", "wall_seconds=2")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.strip().splitlines()
        assert len(lines) == 1, out.stdout
        record = json.loads(lines[0])
        assert record["isolation"] == "bwrap" and "observation" in record
        if name == "passwd":
            assert "root:" not in record["output"] and record["violations"] == ["read /etc/passwd"]
        if name == "kill_parent":
            assert "PermissionError" in record["output"] or "ProcessLookupError" in record["output"], record
        if name == "write_outside":
            assert not outside.exists() and record["exit_code"] == 1
        if name == "setsid_sleeper":
            assert record["killed_by"] == "wall"
            alive = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).find("sleep 7.4321") >= 0]
            assert not alive, alive


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_sandbox_check_reports_each_layer_and_refuses_a_node_without_bubblewrap(tmp_path):
    out = _cli("sandbox", "check", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    layers = {row["layer"]: row["holds"] for row in report["layers"]}
    assert report["isolation"] == "bwrap" and report["error"] is None
    for layer in ("non-root uid", "own PID namespace", "host files hidden", "interpreter read-only", "no network",
                  "scratch size-limited", "seccomp filter", "no_new_privs"):
        assert layers[layer], (layer, report)
    table = _cli("sandbox", "check")
    assert table.returncode == 0 and "own PID namespace" in table.stdout
    # a node without bubblewrap (a PATH without bwrap: the failure injected): one line, exit 2, and the weak
    # sandbox only by name
    bare = dict(os.environ, PATH=str(tmp_path))
    refused = _cli("sandbox", "check", env=bare)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "bubblewrap (bwrap) is not installed" in refused.stderr and "sandbox.isolation: weak" in refused.stderr
    weak = _cli("sandbox", "check", "--set", "isolation=weak", env=bare)
    assert weak.returncode == 0 and "sandbox: weak" in weak.stdout
