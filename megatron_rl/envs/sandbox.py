"""A subprocess sandbox for the policy's Python: CPU, memory, output and wall-clock limits, no network,
a scratch directory.

    box = Sandbox(SandboxConfig(cpu_seconds=2, memory_mb=512, output_bytes=8192))
    run = box.run("print(sum(range(10)))")
    run.output, run.exit_code, run.killed_by          # "45\\n", 0, None
    box.isolation                                      # "namespace" or "audit_hook" (chosen once)

Layers (sandbox_child.py has the child's side):
- kernel: a new session (the whole process group is SIGKILLed at the wall-clock limit or when the
  output passes its cap); with `unshare` allowed (user namespaces), new user and network
  namespaces: no network interface but a downed loopback.  Where `unshare` is refused (`network_isolation: auto` falls back, `namespace` refuses
  to start) the audit hook is the only network barrier: a documented best effort.
- resource limits in the child: CPU seconds, address space, file size, processes, open files.
- an audit hook in the child refusing process creation, sockets and ctypes.
Each run gets a fresh scratch directory as cwd, HOME and TMPDIR, removed afterwards.  What ends a
run is reported (`killed_by`: cpu, wall, output; or the exit code), never hidden: the python
environment turns it into an observation.  Failing to start the sandbox raises SandboxError.
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
from typing import Literal

logger = logging.getLogger(__name__)

CHILD = str(Path(__file__).with_name("sandbox_child.py"))
# no --fork/--pid: unshare then execs the interpreter, whose own exit status (signal) we see
OUTPUT_KILL_FACTOR = 8  # a run writing more than this many times output_bytes is killed
_UNSHARE = ["unshare", "--user", "--map-root-user", "--net"]


class SandboxError(RuntimeError):
    """The sandbox itself could not run the code (not the code's fault): an env_error."""


@dataclasses.dataclass(kw_only=True)
class SandboxConfig:
    """Limits of one sandboxed run (the `python` environment's `sandbox` section)."""

    cpu_seconds: int = 2
    """CPU seconds of the code (RLIMIT_CPU); past it the process is killed."""
    wall_seconds: float = 5.0
    """Wall-clock seconds of one run, start-up included; past it the process group is killed."""
    memory_mb: int = 512
    """Address space in MiB (RLIMIT_AS); a larger allocation raises MemoryError."""
    output_bytes: int = 8192
    """stdout + stderr kept (its first and last halves); the run is killed past 8x this (OUTPUT_KILL_FACTOR)."""
    file_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE)."""
    max_processes: int = 16
    """RLIMIT_NPROC (not enforced by the kernel for root)."""
    network_isolation: Literal["auto", "namespace", "audit_hook"] = "auto"
    """auto: a network namespace when unshare works, else the audit hook only; namespace: require it."""
    python: str = ""
    """Interpreter for the code; empty = the one running the project."""

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_mb", "output_bytes", "file_mb", "max_processes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sandbox.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.wall_seconds, (int, float)) or self.wall_seconds <= 0:
            raise ValueError(f"sandbox.wall_seconds must be > 0, got {self.wall_seconds!r}")
        if self.network_isolation not in ("auto", "namespace", "audit_hook"):
            raise ValueError(f"sandbox.network_isolation must be auto, namespace or audit_hook, "
                             f"got {self.network_isolation!r}")


@dataclasses.dataclass(frozen=True)
class RunResult:
    output: str
    """stdout and stderr interleaved: the first and last output_bytes / 2 (UTF-8, errors replaced)."""
    exit_code: int | None
    """The process's exit code; negative: killed by that signal; None when the sandbox killed it."""
    killed_by: str | None
    """"cpu", "wall" or "output" when a limit ended the run, else None."""
    seconds: float


@functools.lru_cache(maxsize=None)
def namespaces_available() -> bool:
    """Whether this machine lets us create user + network namespaces (probed once)."""
    if shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run([*_UNSHARE, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def choose_isolation(mode: str) -> str:
    if mode == "audit_hook":
        return "audit_hook"
    if namespaces_available():
        return "namespace"
    if mode == "namespace":
        raise SandboxError("sandbox.network_isolation is 'namespace' but unshare cannot create user/network "
                           "namespaces here; use 'auto' (audit hook only) or allow user namespaces")
    logger.warning("unshare cannot create namespaces here: the sandbox's only network barrier is the audit hook")
    return "audit_hook"


class Sandbox:
    def __init__(self, config: SandboxConfig):
        self.config = config
        self.isolation = choose_isolation(config.network_isolation)
        self.python = shutil.which(config.python or sys.executable)
        if self.python is None:
            raise SandboxError(f"sandbox.python {config.python!r} is not an executable on PATH")
        self.running: subprocess.Popen | None = None  # the run in progress, for kill()
        c = config
        self._limits = json.dumps({"cpu_seconds": c.cpu_seconds, "memory_bytes": c.memory_mb << 20,
                                   "file_bytes": c.file_mb << 20, "max_processes": c.max_processes})

    def run(self, code: str) -> RunResult:
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        scratch = tempfile.mkdtemp(prefix="sandbox-")
        try:
            return self._run_in(scratch, code)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _run_in(self, scratch: str, code: str) -> RunResult:
        code_path = os.path.join(scratch, "main.py")
        with open(code_path, "w", encoding="utf-8") as f:
            f.write(code)
        prefix = _UNSHARE if self.isolation == "namespace" else []
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
        start = time.monotonic()
        try:
            proc = subprocess.Popen([*prefix, self.python, "-I", "-B", "-u", CHILD, self._limits, code_path],
                                    cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as err:
            raise SandboxError(f"cannot start the sandbox ({self.python}): {err}") from None
        self.running = proc
        try:
            output, killed_by = self._collect(proc, start)
        finally:
            _kill_group(proc)
            proc.wait()
            proc.stdout.close()
            self.running = None
        seconds = time.monotonic() - start
        if prefix and proc.returncode in (126, 127) and output.startswith(b"unshare:"):
            raise SandboxError(f"unshare could not start the interpreter: {output[:300].decode(errors='replace')}")
        exit_code = None if killed_by in ("wall", "output") else proc.returncode
        # RLIMIT_CPU sends SIGXCPU, then SIGKILL at the hard limit; CPU time never exceeds wall time
        if killed_by is None and (proc.returncode == -signal.SIGXCPU or
                                  (proc.returncode == -signal.SIGKILL and seconds >= self.config.cpu_seconds)):
            killed_by = "cpu"
        return RunResult(output=output.decode("utf-8", errors="replace"), exit_code=exit_code,
                         killed_by=killed_by, seconds=seconds)

    def _collect(self, proc: subprocess.Popen, start: float) -> tuple[bytes, str | None]:
        """Read the output until EOF or the wall-clock deadline; kill past OUTPUT_KILL_FACTOR x the cap."""
        deadline = start + self.config.wall_seconds
        kept = _HeadTail(self.config.output_bytes)
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


class _HeadTail:
    """The first and last `cap // 2` bytes of a stream (a traceback's last line is what matters)."""

    def __init__(self, cap: int):
        self.half = max(cap // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.half - len(self.head)
        self.head += data[:max(room, 0)]
        self.tail += data[max(room, 0):]
        del self.tail[:-self.half]

    def value(self) -> bytes:
        cut = self.total - len(self.head) - len(self.tail)
        middle = f"\n[... {cut} bytes cut ...]\n".encode() if cut > 0 else b""
        return bytes(self.head) + middle + bytes(self.tail)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (its own session, started by us); gone already is fine."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
