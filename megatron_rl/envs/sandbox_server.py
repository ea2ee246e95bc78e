"""A sandbox server speaking /run_code (sandbox_service.py has the wire format): `megatron-rl sandbox serve`.

    server = make_server(SandboxConfig(), host="127.0.0.1", port=8080, token="...")
    server.serve_forever()

Each request runs in this node's sandbox (bubblewrap unless the config says otherwise) under the
server's limits, lowered by the request's run_timeout / memory_limit_MB when those are smaller.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_rl.envs.sandbox import Sandbox, SandboxConfig, SandboxError

logger = logging.getLogger(__name__)
MAX_BODY = 1 << 20


def answer_for(box: Sandbox, request: dict) -> dict:
    """The /run_code response for one request, run in `box` under limits no higher than its own."""
    if request.get("language", "python") != "python" or not isinstance(request.get("code"), str):
        return {"status": "Failed", "message": "only language 'python' with a string 'code' is served",
                "run_result": None}
    limits = box.config
    ask = {"wall_seconds": request.get("run_timeout"), "memory_mb": request.get("memory_limit_MB")}
    lowered = {k: type(getattr(limits, k))(v) for k, v in ask.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < getattr(limits, k)}
    runner = Sandbox(dataclasses.replace(limits, **lowered)) if lowered else box
    try:
        run = runner.run(request["code"])
    except SandboxError as err:
        return {"status": "SandboxError", "message": str(err), "run_result": None}
    status = "TimeLimitExceeded" if run.killed_by in ("wall", "cpu") else (
        "Finished" if run.exit_code == 0 else "Error")
    return {"status": "Success" if status == "Finished" else "Failed", "message": "",
            "run_result": {"status": status, "execution_time": run.seconds, "return_code": run.exit_code,
                           "stdout": run.output, "stderr": "", "killed_by": run.killed_by,
                           "violations": list(run.violations)}}


def make_server(config: SandboxConfig, *, host: str = "127.0.0.1", port: int = 0, token: str = "") -> ThreadingHTTPServer:
    """A /run_code server (not yet serving: call serve_forever); port 0 picks a free one (server_address)."""
    box = Sandbox(config)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # the access log goes to the logger, not stderr
            logger.info("sandbox service: " + fmt, *args)

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") != "/run_code":
                return self._send(404, {"status": "Failed", "message": f"no such endpoint {self.path}"})
            if token and not hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {token}"):
                return self._send(401, {"status": "Failed", "message": "missing or wrong bearer token"})
            length = int(self.headers.get("Content-Length") or 0)
            if length <= 0 or length > MAX_BODY:
                return self._send(413, {"status": "Failed", "message": f"body must be 1..{MAX_BODY} bytes"})
            try:
                request = json.loads(self.rfile.read(length))
            except ValueError as err:
                return self._send(400, {"status": "Failed", "message": f"body is not JSON: {err}"})
            if not isinstance(request, dict):
                return self._send(400, {"status": "Failed", "message": "body must be a JSON object"})
            return self._send(200, answer_for(box, request))

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server
