"""`megatron-rl sandbox check | run | serve`: what isolation this node gives the policy's code, one run through it,
and a sandbox server.

    megatron-rl sandbox check [--json] [--config RUN.yaml]     # each layer, observed from inside a sandboxed run
    megatron-rl sandbox run FILE [--config RUN.yaml]           # one JSON line: exit, output, what the episode sees
    megatron-rl sandbox serve [--host 127.0.0.1] [--port 8080] [--token-file F]   # SandboxFusion's /run_code

The sandbox's settings are the run config's `data.env.options.sandbox` (the `python` environment's)
with `--config`, else the defaults (bubblewrap); `--set key=value` overrides one (e.g. isolation=weak).
Run `check` on a compute node before training: a node where bubblewrap cannot run makes `check` exit
2 with the reason, as the run itself would refuse to start.  `check` reports what a probe run saw,
not what the config asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_rl.config import ConfigError, from_dict, read_config_data
from megatron_rl.envs import bwrap, cgroups
from megatron_rl.envs.sandbox import Sandbox, SandboxConfig, SandboxError

# runs inside the sandbox (under its audit hook: it reads only what any code may read)
PROBE = r"""
import json, os, resource, sys
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key + ':'):
            return line.split()[1]
ifaces = [l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]]
try:
    open(os.path.join(sys.base_prefix, 'probe-write'), 'w')
    interpreter_writable = True
except OSError:
    interpreter_writable = False
scratch = os.statvfs('.')
print(json.dumps({
    'uid': os.getuid(), 'pid': os.getpid(), 'parent_pid': os.getppid(),
    'host_files_visible': [p for p in ('/etc/passwd', '/etc/hostname', '/home', '/var', '/run', '/sys/fs/cgroup',
                                       '/root/.ssh', '/root/.bashrc') if os.path.exists(p)],
    'interfaces': ifaces, 'interpreter_writable': interpreter_writable,
    'scratch_mb': scratch.f_blocks * scratch.f_frsize >> 20, 'seccomp': status('Seccomp'),
    'no_new_privs': status('NoNewPrivs'),
    'rlimits': {n: resource.getrlimit(getattr(resource, 'RLIMIT_' + n))[0] for n in ('CPU', 'AS', 'FSIZE', 'NPROC')},
}))
"""


def sandbox_config(path: str | None, overrides: list[str]) -> SandboxConfig:
    section: dict = {}
    if path:
        data = read_config_data(path)
        env = (data.get("data") or {}).get("env") or {}
        section = dict((env.get("options") or {}).get("sandbox") or {})
    section.update(read_config_data(None, [f"s.{o}" for o in overrides]).get("s", {}))
    try:
        return from_dict(SandboxConfig, section, where="sandbox")
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _layers(box: Sandbox, seen: dict) -> list[tuple[str, bool, str]]:
    """(layer, holds, evidence) from a probe run's report."""
    limits = seen["rlimits"]
    rows = [("non-root uid", seen["uid"] != 0, f"uid {seen['uid']}"),
            ("own PID namespace", seen["parent_pid"] in (0, 1) or seen["pid"] < 10,
             f"pid {seen['pid']}, parent {seen['parent_pid']}"),
            ("host files hidden", not seen["host_files_visible"],
             ", ".join(seen["host_files_visible"]) + " visible" if seen["host_files_visible"] else "none of /etc, /home, /var, "
             "/run, /sys/fs/cgroup, root's files"),
            ("interpreter read-only", not seen["interpreter_writable"], "write to sys.base_prefix refused"
             if not seen["interpreter_writable"] else "the code can write the interpreter's files"),
            ("no network", seen["interfaces"] in ([], ["lo"]), "interfaces: " + (", ".join(seen["interfaces"]) or "none")),
            ("scratch size-limited", box.isolation == "bwrap", f"{seen['scratch_mb']} MiB"),
            ("seccomp filter", seen["seccomp"] == "2", f"Seccomp: {seen['seccomp']}"),
            ("no_new_privs", seen["no_new_privs"] == "1", f"NoNewPrivs: {seen['no_new_privs']}"),
            ("rlimits", limits["CPU"] > 0 and limits["AS"] > 0, ", ".join(f"{k} {v}" for k, v in limits.items()))]
    if box.isolation == "bwrap":
        groups = cgroups.available()
        rows.append(("cgroup memory+pids", set(groups) == {"memory", "pids"},
                     ", ".join(groups) if groups else "none writable here (rlimits and tmpfs sizes only)"))
    return rows


def _cmd_check(args: argparse.Namespace) -> int:
    config = sandbox_config(args.config, args.set)
    status = bwrap.probe(config.python)
    report = {"isolation": config.isolation, "bwrap": status, "layers": [], "error": None}
    try:
        box = Sandbox(config)
        run = box.run(PROBE)
        if run.exit_code != 0:
            raise SandboxError(f"the probe run failed: {run.output.strip()[-300:]}")
        seen = json.loads(run.output.strip().splitlines()[-1])
        report["isolation"] = box.isolation
        report["layers"] = [{"layer": n, "holds": ok, "evidence": e} for n, ok, e in _layers(box, seen)]
    except SandboxError as err:
        report["error"] = str(err)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"sandbox: {report['isolation']}; bubblewrap: {status['bwrap'] or 'not installed'}"
              + (f" {status['version']}" if status["version"] else "")
              + (f", {status['user']}" if status["user"] else ""))
        for row in report["layers"]:
            print(f"  {'yes' if row['holds'] else 'NO ':<4} {row['layer']:<22} {row['evidence']}")
        if report["error"]:
            print(f"megatron-rl sandbox: error: {report['error']}", file=sys.stderr)
    return 2 if report["error"] else 0


def _cmd_run(args: argparse.Namespace) -> int:
    from megatron_rl.envs.python_tool import describe_run

    config = sandbox_config(args.config, args.set)
    try:
        with open(args.file, encoding="utf-8") as f:
            code = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read {args.file}: {err}") from None
    try:
        box = Sandbox(config)
        run = box.run(code)
    except SandboxError as err:
        print(json.dumps({"isolation": config.isolation, "error": str(err)}))
        return 2
    print(json.dumps({"isolation": box.isolation, "exit_code": run.exit_code, "killed_by": run.killed_by,
                      "seconds": round(run.seconds, 3), "output": run.output, "violations": list(run.violations),
                      "observation": describe_run(run, config)}))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from megatron_rl.envs.sandbox_server import make_server

    config = sandbox_config(args.config, args.set)
    token = ""
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as f:
            token = f.read().strip()
        if os.stat(args.token_file).st_mode & 0o077:
            raise ConfigError(f"{args.token_file} is readable by others: chmod 600 it")
    try:
        server = make_server(config, host=args.host, port=args.port, token=token)
    except SandboxError as err:
        raise ConfigError(str(err)) from None
    print(f"sandbox service ({Sandbox(config).isolation}) on http://{args.host}:{server.server_address[1]}/run_code",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def register(sub) -> None:
    p = sub.add_parser("sandbox", help="the policy code's sandbox: check this node, run a file through it, serve it")
    cmds = p.add_subparsers(dest="sandbox_command", metavar="SANDBOX_COMMAND", required=True)
    for name, func, help_ in (("check", _cmd_check, "what isolation this node gives, layer by layer"),
                              ("run", _cmd_run, "run a Python file in the sandbox; print one JSON line"),
                              ("serve", _cmd_serve, "a /run_code sandbox server (SandboxFusion's API)")):
        c = cmds.add_parser(name, help=help_)
        c.add_argument("--config", help="a run config: its data.env.options.sandbox section")
        c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override one sandbox setting, e.g. isolation=weak (repeatable)")
        c.set_defaults(func=func)
    cmds.choices["check"].add_argument("--json", action="store_true", help="one JSON object instead of a table")
    cmds.choices["run"].add_argument("file", help="the Python file to run")
    serve = cmds.choices["serve"]
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--token-file", help="a file (mode 600) holding the bearer token clients must send")
