"""The bubblewrap command line of one sandboxed call, and what this node can give (`megatron-rl sandbox check`).

    argv = BwrapCommand(python, packages=["numpy"], scratch_bytes=64 << 20).argv(inner, code_dir)
    probe()          # {"bwrap": "/usr/bin/bwrap", "version": "0.8.0", "runs": True, "user": "setpriv", ...}

What the code sees (nothing else of the host exists for it):
- read-only: the system's shared libraries and tools (/usr/lib, /usr/lib64, /usr/bin and the /lib,
  /bin links), the interpreter's installation (its prefix: binary and standard library), the packages
  the environment allows (`sandbox.packages`, each at /opt/sandbox/packages/<name>), the child
  script and the code (/opt/sandbox);
- writable: a private tmpfs of `scratch_mb` at /tmp (cwd, HOME, TMPDIR) and one at /dev/shm; both die
  with the call;
- its own PID namespace (the trainer is invisible, so cannot be signalled; bubblewrap is PID 1 and
  everything dies with it), a new session, --die-with-parent; IPC and UTS namespaces;
- a network namespace with only a loopback of its own: no host network, no host unix sockets
  (abstract ones are per network namespace; socket files are not mounted);
- a non-root uid: as root, bubblewrap keeps only CAP_SETUID/CAP_SETGID for `setpriv`, which drops to a
  fresh uid and gid (no groups, no capabilities, no_new_privs) before the interpreter starts; as an
  ordinary user, a user namespace maps the caller's own (non-root) uid;
- the seccomp filter of seccomp.py where the architecture is covered.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from megatron_rl.envs import cgroups
from megatron_rl.envs.seccomp import deny_filter

SANDBOX_DIR = "/opt/sandbox"  # the child script and the code, read-only
PACKAGES_DIR = "/opt/sandbox/packages"
SETPRIV = "/usr/bin/setpriv"
UID_BASE, UID_SPAN = 200_000, 800_000  # root drops to a random uid here: rlimits per uid stay per call
_SYSTEM = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/bin")
_LINKS = {"/lib": "usr/lib", "/lib64": "usr/lib64", "/bin": "usr/bin"}


@functools.lru_cache(maxsize=None)
def interpreter(python: str) -> tuple[str, str]:
    """(the real interpreter binary, its installation prefix) behind `python` (a venv's link included); asked once
    per interpreter (a sandbox server builds a Sandbox for every request that lowers its limits)."""
    binary = os.path.realpath(shutil.which(python) or python)
    out = subprocess.run([binary, "-I", "-c", "import sys; print(sys.base_prefix)"], capture_output=True,
                         text=True, timeout=30)
    if out.returncode != 0:
        raise OSError(f"{binary} does not run: {out.stderr.strip()[-200:]}")
    return binary, os.path.realpath(out.stdout.strip())


def package_dirs(names: list[str]) -> dict[str, str]:
    """{mount name: host path} of each allowed top-level package (and its wheel's bundled `.libs`)."""
    found: dict[str, str] = {}
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin in (None, "built-in", "frozen") and not spec.submodule_search_locations:
            raise ValueError(f"sandbox.packages: {name!r} is not importable here")
        path = list(spec.submodule_search_locations)[0] if spec.submodule_search_locations else spec.origin
        found[os.path.basename(path)] = path
        libs = Path(path).parent / f"{name}.libs"
        if libs.is_dir():
            found[libs.name] = str(libs)
    return found


class BwrapCommand:
    def __init__(self, python: str, *, packages: list[str], scratch_bytes: int):
        self.python, self.prefix = interpreter(python)
        self.packages = package_dirs(packages)
        self.scratch_bytes = scratch_bytes
        self.as_root = os.geteuid() == 0
        self.filter = deny_filter()

    def argv(self, inner: list[str], code_dir: str, seccomp_fd: int | None) -> list[str]:
        """bwrap ... -- [setpriv ...] inner, with code_dir (the child script, the code) at SANDBOX_DIR."""
        cmd = [shutil.which("bwrap") or "bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc",
               "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
        binds = [(path, path) for path in _SYSTEM if os.path.isdir(path)]
        binds += [(self.prefix, self.prefix), (code_dir, SANDBOX_DIR)]
        binds += [(path, f"{PACKAGES_DIR}/{name}") for name, path in self.packages.items()]
        made: set[str] = set()
        for source, dest in binds:  # bwrap would create the parents 0700: unreadable for the sandbox's uid
            for parent in reversed(Path(dest).parents[:-1]):
                if str(parent) not in made and str(parent) not in _LINKS:
                    made.add(str(parent))
                    cmd += ["--perms", "0755", "--dir", str(parent)]
            cmd += ["--ro-bind", source, dest]
        for link, target in _LINKS.items():
            if os.path.islink(link):
                cmd += ["--symlink", target, link]
            elif os.path.isdir(link):
                cmd += ["--ro-bind", link, link]
        cmd += ["--proc", "/proc", "--dev", "/dev",
                "--perms", "1777", "--size", str(self.scratch_bytes), "--tmpfs", "/tmp",
                "--perms", "1777", "--size", str(self.scratch_bytes), "--tmpfs", "/dev/shm",
                "--chdir", "/tmp", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
                "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8"]
        if seccomp_fd is not None:
            cmd += ["--seccomp", str(seccomp_fd)]
        if self.as_root:
            uid = str(UID_BASE + secrets.randbelow(UID_SPAN))
            cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--",
                    SETPRIV, "--reuid", uid, "--regid", uid, "--clear-groups", "--no-new-privs",
                    "--inh-caps=-all", "--bounding-set=-all", "--"]
        else:
            cmd += ["--unshare-user", "--"]
        return cmd + inner


@functools.lru_cache(maxsize=None)
def probe(python: str = "") -> dict:
    """What bubblewrap gives on this node: each layer, and `runs` (a trial run succeeded) with `error` if not."""
    found = shutil.which("bwrap")
    report = {"bwrap": found, "version": None, "runs": False, "error": None, "user": None,
              "seccomp": deny_filter() is not None, "cgroups": cgroups.available(), "root": os.geteuid() == 0}
    if found is None:
        report["error"] = "bubblewrap (bwrap) is not installed: apt-get install bubblewrap (or your distro's package)"
        return report
    version = subprocess.run([found, "--version"], capture_output=True, text=True)
    report["version"] = version.stdout.strip().rpartition(" ")[2] or None
    if report["root"] and not os.access(SETPRIV, os.X_OK):
        report["error"] = f"running as root needs {SETPRIV} (util-linux) to drop to a non-root uid"
        return report
    try:
        cmd = BwrapCommand(python or sys.executable, packages=[], scratch_bytes=1 << 20)
        with FilterFd(cmd.filter) as fd:
            trial = subprocess.run(cmd.argv([cmd.python, "-I", "-c", "import os; print(os.getuid())"],
                                            os.path.dirname(__file__), fd),
                                   capture_output=True, text=True, timeout=30, pass_fds=() if fd is None else (fd,))
    except (OSError, subprocess.TimeoutExpired, ValueError) as err:
        report["error"] = f"bubblewrap could not start: {err}"
        return report
    if trial.returncode != 0:
        report["error"] = f"bubblewrap could not start: {(trial.stderr or trial.stdout).strip()[-300:]}"
        return report
    uid = int(trial.stdout.strip() or -1)
    report.update(runs=True, user=f"uid {uid}" + (" (setpriv from root)" if report["root"] else " (user namespace)"))
    return report


class FilterFd:
    """A pipe's read end holding the seccomp program (bwrap reads it at start); None without a program."""

    def __init__(self, program: bytes | None):
        self.program = program
        self.fd: int | None = None

    def __enter__(self) -> int | None:
        if self.program is None:
            return None
        read, write = os.pipe()
        os.write(write, self.program)  # a few hundred bytes: well under a pipe's buffer
        os.close(write)
        self.fd = read
        return read

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)

