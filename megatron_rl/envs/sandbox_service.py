"""A sandbox service: the policy's code sent over HTTP to a server that runs it (`sandbox.isolation: service`).

    sandbox: {isolation: service, service_url: "http://sandbox-host:8080", service_token_file: token}
    megatron-rl sandbox serve --port 8080 --token-file token     # one such server (bubblewrap inside)

The wire format is SandboxFusion's `POST /run_code` (the service verl uses), so either server works:
    request:  {"code": str, "language": "python", "run_timeout": s, "memory_limit_MB": int}
    response: {"status": "Success" | "Failed" | "SandboxError", "message": str,
               "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "execution_time": s,
                              "return_code": int | null, "stdout": str, "stderr": str}}
Our server (sandbox_server.py) adds `killed_by` and `violations` to run_result (a SandboxFusion
server leaves them out: a time limit then reads as killed_by "wall", and no violations are known).
Its own limits are ceilings: a request may lower them, never raise them.  It listens on loopback
unless told otherwise and refuses requests without the bearer token when it has one.  A server that cannot be reached or answers SandboxError is the sandbox's failure (SandboxError:
the episode's env_error), never the code's.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

from megatron_rl.envs.sandbox_types import HeadTail, RunResult, SandboxConfig, SandboxError

logger = logging.getLogger(__name__)
MAX_ANSWER = 8 << 20  # bytes of a response read at most
NETWORK_SLACK_S = 30.0  # on top of the run's wall limit before the client gives up on the server


def _read_token(path: str) -> str:
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise SandboxError(f"sandbox.service_token_file {path!r} cannot be read: {err}") from None
    if not token:
        raise SandboxError(f"sandbox.service_token_file {path!r} is empty")
    return token


class ServiceClient:
    def __init__(self, config: SandboxConfig):
        self.config = config
        self.url = config.service_url.rstrip("/") + "/run_code"
        self.token = _read_token(config.service_token_file)

    def run(self, code: str) -> RunResult:
        c = self.config
        body = json.dumps({"code": code, "language": "python", "run_timeout": c.wall_seconds,
                           "memory_limit_MB": c.memory_mb}).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=c.wall_seconds + NETWORK_SLACK_S) as response:
                answer = json.loads(response.read(MAX_ANSWER))
        except urllib.error.HTTPError as err:
            raise SandboxError(f"sandbox service {self.url} answered HTTP {err.code}: "
                               f"{err.read(300).decode(errors='replace')}") from None
        except (OSError, ValueError) as err:
            raise SandboxError(f"sandbox service {self.url} failed: {err}") from None
        return _result_of(answer, c.output_bytes, self.url)


def _result_of(answer: dict, output_bytes: int, url: str) -> RunResult:
    run = answer.get("run_result") if isinstance(answer, dict) else None
    if not isinstance(run, dict) or answer.get("status") == "SandboxError":
        message = answer.get("message", "") if isinstance(answer, dict) else str(answer)[:200]
        raise SandboxError(f"sandbox service {url} could not run the code: {message or 'no run_result'}")
    kept = HeadTail(output_bytes)
    kept.add(((run.get("stdout") or "") + (run.get("stderr") or "")).encode())
    killed_by = run.get("killed_by") or ("wall" if run.get("status") == "TimeLimitExceeded" else None)
    code = run.get("return_code")
    return RunResult(output=kept.value().decode("utf-8", errors="replace"),
                     exit_code=None if killed_by in ("wall", "output") else code, killed_by=killed_by,
                     seconds=float(run.get("execution_time") or 0.0),
                     violations=tuple(str(v) for v in run.get("violations", ()))[:100])
