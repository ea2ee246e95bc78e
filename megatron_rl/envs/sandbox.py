"""The sandbox for the policy's code: bubblewrap by default, a sandbox service at scale, `weak` only if asked.

    box = Sandbox(SandboxConfig(cpu_seconds=2, memory_mb=512, output_bytes=8192))
    run = box.run("print(sum(range(10)))")
    run.output, run.exit_code, run.killed_by, run.violations   # "45\\n", 0, None, ()
    box.isolation                                                # "bwrap" (chosen once)

`sandbox.isolation` picks the backend:
- `bwrap` (default): each call in a fresh bubblewrap sandbox (bwrap.py has what it sees: read-only
  interpreter and allowed packages, a private tmpfs scratch, its own PID and network namespaces, a
  non-root uid, the seccomp filter of seccomp.py) inside a control group of its own (cgroups.py:
  memory with tmpfs and shm, processes) where the host allows.  Where bubblewrap cannot run the
  Sandbox is not built: SandboxError says what the node lacks (the run refuses to start).
- `service`: the code goes over HTTP to a sandbox server (sandbox_service.py; SandboxFusion's
  /run_code shape; `megatron-rl sandbox serve` is one).
- `weak`: a subprocess with rlimits, an audit hook and, where `unshare` works, a network namespace;
  it isolates neither files nor processes.  Used only when set explicitly, logged at start and
  recorded in the run manifest.
In every local backend the child (sandbox_child.py) applies rlimits (CPU seconds, address space,
file size, processes, open files) and an audit hook that refuses process creation, sockets, signals,
ctypes look-ups and writes outside scratch, reporting each attempt: `RunResult.violations`.  What
ends a run is reported (`killed_by`: cpu, wall, output; or the exit code), never hidden.  Failing to
run the code at all raises SandboxError (an env_error, never a score).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_rl.envs import bwrap, cgroups
from megatron_rl.envs.sandbox_types import OUTPUT_KILL_FACTOR, HeadTail, RunResult, SandboxConfig, SandboxError

__all__ = ["OUTPUT_KILL_FACTOR", "RunResult", "Sandbox", "SandboxConfig", "SandboxError", "namespaces_available"]

logger = logging.getLogger(__name__)

CHILD = str(Path(__file__).with_name("sandbox_child.py"))
# no --fork/--pid: unshare then execs the interpreter, whose own exit status (signal) we see
_UNSHARE = ["unshare", "--user", "--map-root-user", "--net"]
# what the code may read without it counting as a violation (besides scratch and the interpreter)
_READABLE = ["/usr", "/lib", "/lib64", "/bin", "/dev/null", "/dev/zero", "/dev/urandom", "/dev/random",
             "/proc/self", "/proc/thread-self", "/sys/devices/system/cpu", bwrap.SANDBOX_DIR]


@functools.lru_cache(maxsize=None)
def namespaces_available() -> bool:
    """Whether this machine lets us create user + network namespaces (probed once; the weak backend)."""
    if shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run([*_UNSHARE, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def choose_isolation(config: SandboxConfig) -> str:
    """The backend this config gets here: 'bwrap', 'service', 'weak:namespace' or 'weak:audit_hook'."""
    if config.isolation == "bwrap":
        status = bwrap.probe(config.python)
        if not status["runs"]:
            raise SandboxError(f"sandbox.isolation is 'bwrap' but {status['error']}; install bubblewrap "
                               f"(`megatron-rl sandbox check` shows what this node gives), or set "
                               f"sandbox.isolation: weak to accept a sandbox without file or process isolation")
        return "bwrap"
    if config.isolation == "service":
        return "service"
    logger.warning("sandbox.isolation is 'weak': the policy's code can read and write the trainer's files "
                   "and see its processes (only rlimits and an audit hook hold it)")
    if config.network_isolation == "audit_hook":
        return "weak:audit_hook"
    if namespaces_available():
        return "weak:namespace"
    if config.network_isolation == "namespace":
        raise SandboxError("sandbox.network_isolation is 'namespace' but unshare cannot create user/network "
                           "namespaces here; use 'auto' (audit hook only) or allow user namespaces")
    logger.warning("unshare cannot create namespaces here: the weak sandbox's only network barrier is the audit hook")
    return "weak:audit_hook"


class Sandbox:
    def __init__(self, config: SandboxConfig):
        self.config = config
        self.running: subprocess.Popen | None = None  # the run in progress, for kill()
        self.python = shutil.which(config.python or sys.executable)
        if self.python is None and config.isolation != "service":
            raise SandboxError(f"sandbox.python {config.python!r} is not an executable on PATH")
        self.isolation = choose_isolation(config)
        if self.isolation == "service":
            from megatron_rl.envs.sandbox_service import ServiceClient
            self.service = ServiceClient(config)
            return
        self.bwrap = None
        if self.isolation == "bwrap":
            try:
                self.bwrap = bwrap.BwrapCommand(self.python, packages=config.packages,
                                                scratch_bytes=config.scratch_mb << 20)
            except (OSError, ValueError) as err:
                raise SandboxError(str(err)) from None
        c = config
        self._limits = {"cpu_seconds": c.cpu_seconds, "memory_bytes": c.memory_mb << 20,
                        "file_bytes": c.file_mb << 20, "max_processes": c.max_processes}

    def run(self, code: str) -> RunResult:
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        if self.isolation == "service":
            return self.service.run(code)
        host_dir = tempfile.mkdtemp(prefix="sandbox-")
        try:
            return self._run_in(host_dir, code)
        finally:
            shutil.rmtree(host_dir, ignore_errors=True)

    def _command(self, host_dir: str, report_fd: int, seccomp_fd: int | None) -> tuple[list[str], str]:
        """(argv, cwd) of one call; host_dir holds the code (and, for bwrap, the child script)."""
        settings = dict(self._limits, report_fd=report_fd)
        if self.bwrap is not None:
            shutil.copy(CHILD, os.path.join(host_dir, "child.py"))
            os.chmod(host_dir, 0o755)  # the sandbox's uid reads them through a read-only bind
            for name in os.listdir(host_dir):
                os.chmod(os.path.join(host_dir, name), 0o644)
            packages = [f"{bwrap.PACKAGES_DIR}"] if self.bwrap.packages else []
            settings.update(scratch=["/tmp", "/dev/shm"], readable=[self.bwrap.prefix, *_READABLE, *packages],
                            paths=packages)
            inner = [self.bwrap.python, "-I", "-B", "-u", f"{bwrap.SANDBOX_DIR}/child.py", json.dumps(settings),
                     f"{bwrap.SANDBOX_DIR}/main.py"]
            return self.bwrap.argv(inner, host_dir, seccomp_fd), "/"
        settings.update(scratch=[host_dir], readable=[sys.base_prefix, *_READABLE], paths=[])
        prefix = _UNSHARE if self.isolation == "weak:namespace" else []
        inner = [*prefix, self.python, "-I", "-B", "-u", CHILD, json.dumps(settings),
                 os.path.join(host_dir, "main.py")]
        return inner, host_dir

    def _run_in(self, host_dir: str, code: str) -> RunResult:
        with open(os.path.join(host_dir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        report_r, report_w = os.pipe()
        os.set_blocking(report_r, False)
        group = None
        with bwrap.FilterFd(self.bwrap.filter if self.bwrap else None) as seccomp_fd:
            argv, cwd = self._command(host_dir, report_w, seccomp_fd)
            if self.bwrap is not None:
                group = cgroups.CallGroup.create(memory_bytes=(self.config.memory_mb + 2 * self.config.scratch_mb) << 20,
                                                 max_pids=self.config.max_processes + 2)
                argv = group.enter_argv(argv) if group else argv
            env = {"PATH": "/usr/bin:/bin", "HOME": host_dir, "TMPDIR": host_dir, "LANG": "C.UTF-8"}
            start = time.monotonic()
            fds = (report_w,) if seccomp_fd is None else (report_w, seccomp_fd)
            try:
                proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True, pass_fds=fds)
            except OSError as err:
                os.close(report_r)
                raise SandboxError(f"cannot start the sandbox ({argv[0]}): {err}") from None
            finally:
                os.close(report_w)
        self.running = proc
        try:
            output, killed_by = self._collect(proc, start)
        finally:
            _kill_group(proc)
            proc.wait()
            proc.stdout.close()
            self.running = None
            violations = _read_reports(report_r)
            if group is not None:
                group.remove()
        seconds = time.monotonic() - start
        returncode = proc.returncode
        if self.isolation == "weak:namespace" and returncode in (126, 127) and output.startswith(b"unshare:"):
            raise SandboxError(f"unshare could not start the interpreter: {output[:300].decode(errors='replace')}")
        if self.bwrap is not None:
            if output.startswith(b"bwrap:") or output.startswith(b"setpriv:"):
                raise SandboxError(f"bubblewrap could not start the code: {output[:300].decode(errors='replace')}")
            if returncode > 128:  # bwrap reports a child killed by signal N as 128 + N
                returncode = -(returncode - 128)
        exit_code = None if killed_by in ("wall", "output") else returncode
        # RLIMIT_CPU sends SIGXCPU, then SIGKILL at the hard limit; CPU time never exceeds wall time
        if killed_by is None and (returncode == -signal.SIGXCPU or
                                  (returncode == -signal.SIGKILL and seconds >= self.config.cpu_seconds)):
            killed_by = "cpu"
        return RunResult(output=output.decode("utf-8", errors="replace"), exit_code=exit_code,
                         killed_by=killed_by, seconds=seconds, violations=violations)

    def _collect(self, proc: subprocess.Popen, start: float) -> tuple[bytes, str | None]:
        """Read the output until EOF or the wall-clock deadline; kill past OUTPUT_KILL_FACTOR x the cap."""
        deadline = start + self.config.wall_seconds
        kept = HeadTail(self.config.output_bytes)
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return kept.value(), "wall"
                if not sel.select(timeout=left):
                    continue
                data = os.read(proc.stdout.fileno(), 65536)
                if not data:
                    break
                kept.add(data)
                if kept.total > OUTPUT_KILL_FACTOR * self.config.output_bytes:
                    return kept.value(), "output"
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            return kept.value(), "wall"
        return kept.value(), None

    def kill(self) -> None:
        """SIGKILL the run in progress, if any (from another thread: a step that timed out)."""
        proc = self.running
        if proc is not None and proc.poll() is None:
            _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (its own session, started by us); gone already is fine."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_reports(fd: int) -> tuple[str, ...]:
    """The child's violation reports (one per line) from the pipe's read end, then close it."""
    data = b""
    try:
        while len(data) < 1 << 16:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:  # a process of the call still holds the write end: what arrived is enough
        pass
    finally:
        os.close(fd)
    return tuple(line for line in data.decode("utf-8", errors="replace").splitlines() if line)[:100]
