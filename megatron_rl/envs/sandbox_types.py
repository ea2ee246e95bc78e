"""The sandbox's types: its config, one run's result, its error (sandbox.py runs code; sandbox_service.py sends it).

Split from sandbox.py so that the service client and the local sandbox share them without importing each other.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

OUTPUT_KILL_FACTOR = 8  # a run writing more than this many times output_bytes is killed
ISOLATIONS = ("bwrap", "service", "weak")


class SandboxError(RuntimeError):
    """The sandbox itself could not run the code (not the code's fault): an env_error."""


@dataclasses.dataclass(kw_only=True)
class SandboxConfig:
    """Limits of one sandboxed run (the `python` environment's `sandbox` section)."""

    isolation: Literal["bwrap", "service", "weak"] = "bwrap"
    """bwrap: a bubblewrap sandbox per call (the run refuses to start where it cannot run); service: a
    sandbox server at service_url; weak: rlimits + audit hook (+ network namespace), no file or process
    isolation: explicit only, logged and recorded in the run manifest."""
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
    scratch_mb: int = 64
    """bwrap: size of the private tmpfs at /tmp (and of the one at /dev/shm): all the code may write."""
    max_processes: int = 16
    """Processes and threads of one call: a cgroup's pids.max where the host allows, and RLIMIT_NPROC
    (for a fresh uid per call when the trainer is root; the kernel exempts root itself)."""
    packages: list[str] = dataclasses.field(default_factory=list)
    """bwrap: top-level packages the code may import besides the standard library (e.g. numpy)."""
    network_isolation: Literal["auto", "namespace", "audit_hook"] = "auto"
    """weak only: auto: a network namespace when unshare works, else the audit hook only; namespace: require it."""
    service_url: str = ""
    """service: the server's base URL (POST {service_url}/run_code)."""
    service_token_file: str = ""
    """service: a file holding the bearer token the server expects (empty: none)."""
    python: str = ""
    """Interpreter for the code; empty = the one running the project."""

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_mb", "output_bytes", "file_mb", "scratch_mb", "max_processes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sandbox.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.wall_seconds, (int, float)) or self.wall_seconds <= 0:
            raise ValueError(f"sandbox.wall_seconds must be > 0, got {self.wall_seconds!r}")
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"sandbox.isolation must be one of {', '.join(ISOLATIONS)}, got {self.isolation!r}")
        if self.network_isolation not in ("auto", "namespace", "audit_hook"):
            raise ValueError(f"sandbox.network_isolation must be auto, namespace or audit_hook, "
                             f"got {self.network_isolation!r}")
        if self.isolation == "service" and not self.service_url.startswith(("http://", "https://")):
            raise ValueError(f"sandbox.isolation 'service' needs sandbox.service_url (http://HOST:PORT), "
                             f"got {self.service_url!r}")
        if not isinstance(self.packages, list) or not all(isinstance(p, str) and p for p in self.packages):
            raise ValueError(f"sandbox.packages must be a list of package names, got {self.packages!r}")


@dataclasses.dataclass(frozen=True)
class RunResult:
    output: str
    """stdout and stderr interleaved: the first and last output_bytes / 2 (UTF-8, errors replaced)."""
    exit_code: int | None
    """The process's exit code; negative: killed by that signal; None when the sandbox killed it."""
    killed_by: str | None
    """"cpu", "wall" or "output" when a limit ended the run, else None."""
    seconds: float
    violations: tuple[str, ...] = ()
    """What the code tried and the sandbox refused or flagged ("write /path", "os.fork", ...; at most 100)."""


class HeadTail:
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
