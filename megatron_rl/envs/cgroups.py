"""One control group per sandboxed call: memory (tmpfs and shm pages included) and processes.

    group = CallGroup.create(memory_bytes=768 << 20, max_pids=16)   # None where the host allows neither
    argv = group.enter_argv(argv)     # sh -c 'echo $$ > .../cgroup.procs && exec "$@"' -- argv...
    ...                               # run it; every process it starts is in the group
    group.remove()                    # after the call: the group is empty once its PID namespace died

cgroup v2 (a `memory` / `pids` controller enabled below our own group) or v1 hierarchies (one
directory per controller) are both used where we can create a child group; where neither is
writable (an unprivileged user without delegation) `available()` says so and the sandbox keeps its
rlimits, tmpfs sizes and PID namespace.  The process joins its group itself, before it execs
bubblewrap, so nothing it starts can run outside the group.
"""

from __future__ import annotations

import functools
import os
import secrets
import shlex
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def _own_path(controller: str) -> str | None:
    """Our group's path in the hierarchy of `controller` ('' = the v2 unified one), from /proc/self/cgroup."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if (controller == "" and names == "") or controller in names.split(","):
            return path
    return None


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


@functools.lru_cache(maxsize=None)
def controllers() -> dict[str, Path]:
    """The controllers we may create child groups under: {'memory': dir, 'pids': dir} (either may be missing)."""
    found: dict[str, Path] = {}
    unified = _own_path("")
    v2_dir = ROOT / (unified or "/").lstrip("/") if (ROOT / "cgroup.controllers").exists() else None
    if v2_dir is not None and _writable_dir(v2_dir):
        try:  # v2: a controller must be enabled for our children (and we must not hold processes ourselves)
            enabled = (v2_dir / "cgroup.subtree_control").read_text().split()
        except OSError:
            enabled = []
        for name in ("memory", "pids"):
            if name in enabled:
                found[name] = v2_dir
        return found
    for name in ("memory", "pids"):  # v1: one hierarchy per controller
        own = _own_path(name)
        base = ROOT / name / (own or "/").lstrip("/")
        if own is not None and _writable_dir(base):
            found[name] = base
    return found


def available() -> list[str]:
    return sorted(controllers())


class CallGroup:
    """The control groups of one call (one directory per hierarchy)."""

    def __init__(self, dirs: list[Path]):
        self.dirs = dirs

    @classmethod
    def create(cls, *, memory_bytes: int, max_pids: int) -> "CallGroup | None":
        name = f"megatron-rl-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        dirs: dict[Path, dict[str, str]] = {}
        for controller, base in controllers().items():
            limits = dirs.setdefault(base / name, {})
            if controller == "pids":
                limits["pids.max"] = str(max_pids)
            elif (base / "memory.max").exists() or (base / "cgroup.controllers").exists():
                limits["memory.max"] = str(memory_bytes)
                limits["memory.swap.max"] = "0"
            else:
                limits["memory.limit_in_bytes"] = str(memory_bytes)
        made = []
        for path, limits in dirs.items():
            try:
                path.mkdir()
                made.append(path)
                for key, value in limits.items():
                    if (path / key).exists():
                        (path / key).write_text(value)
            except OSError:
                continue  # this hierarchy refuses us: the others still apply
        return cls(made) if made else None

    def enter_argv(self, argv: list[str]) -> list[str]:
        """argv prefixed by a shell that moves itself into every group, then execs argv."""
        joins = " && ".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}" for d in self.dirs)
        return ["/bin/sh", "-c", f'{joins} && exec "$@"', "sandbox", *argv]

    def remove(self, wait_s: float = 2.0) -> None:
        """Remove the groups once empty (a PID namespace's processes die asynchronously)."""
        deadline = time.monotonic() + wait_s
        for path in self.dirs:
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
