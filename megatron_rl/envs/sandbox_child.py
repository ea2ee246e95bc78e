"""The sandbox's child side: limits itself, closes the doors, then runs the policy's code.

    python -I -B -u sandbox_child.py SETTINGS_JSON CODE_FILE     # started by sandbox.Sandbox.run only

SETTINGS_JSON: the limits, `scratch` (the writable directories), `paths` (allowed package
directories, put on sys.path) and `report_fd` (a pipe the parent reads; -1 for none).
1. resource limits on this process (inherited by anything it could start): CPU seconds
   (RLIMIT_CPU: SIGXCPU, then SIGKILL one second later), address space (RLIMIT_AS: a large
   allocation raises MemoryError), file size (RLIMIT_FSIZE), processes (RLIMIT_NPROC, which the
   kernel does not enforce for root) and open files;
2. an audit hook (PEP 578; it cannot be removed once added) that refuses process creation
   (fork, exec, spawn, system, subprocess), sockets, signals, ctypes symbol look-ups (which could
   call fork or socket directly) and writes outside the scratch directories with PermissionError;
   each refusal, each read outside the places the code may read, and each import of a C module that
   goes around the hook (_posixsubprocess, _ctypes) by the code itself is reported on `report_fd`
   as one line (at most MAX_REPORTS): the parent counts them as sandbox violations;
3. the code runs as `__main__`; a traceback shows only the policy's own frames.

The hook is a layer inside the interpreter: C code can go around it.  What holds when it is
bypassed is the parent's: bubblewrap's namespaces, read-only mounts, non-root uid and seccomp filter
(bwrap.py), or, only with `sandbox.isolation: weak`, a network namespace and a killed session.
This file imports nothing from the project (it runs outside it).
"""

import json
import os
import resource
import sys
import traceback

BLOCKED_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill", "os.killpg",
    "subprocess.Popen", "pty.spawn", "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
    "socket.sendto", "ctypes.dlsym", "ctypes.cdata", "signal.pthread_kill",
})  # ctypes.dlopen stays allowed: numpy imports ctypes; looking up a C function (dlsym) is refused
WRITE_EVENTS = frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                          "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile"})
READ_EVENTS = frozenset({"os.listdir", "os.scandir"})
# C modules that reach fork/exec and raw C calls without audit events: imported by the code itself, a violation
RAW_MODULES = frozenset({"_posixsubprocess", "_ctypes", "_xxsubinterpreters"})
MAX_REPORTS = 100
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class _Doors:
    def __init__(self, settings):
        self.scratch = tuple(os.path.abspath(p) for p in settings["scratch"])
        self.readable = self.scratch + tuple(os.path.abspath(p) for p in settings["readable"])
        self.fd = int(settings.get("report_fd", -1))
        self.reported = 0
        self.imported = set()

    def report(self, what):
        if self.fd < 0 or self.reported >= MAX_REPORTS:
            return
        self.reported += 1
        try:
            os.write(self.fd, (what.replace("\n", " ")[:200] + "\n").encode("utf-8", "replace"))
        except OSError:
            self.fd = -1

    @staticmethod
    def _under(path, roots):
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            return True  # a file descriptor: opened under these rules already
        path = os.path.normpath(os.path.join(os.getcwd(), path))
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

    def __call__(self, event, args):
        if event in BLOCKED_EVENTS:
            self.report(event)
            raise PermissionError(f"{event} is not allowed in the sandbox (no processes, no network, no signals)")
        if event == "open" and args:
            path, mode, flags = (list(args) + [None, None])[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS)
            if writes and not self._under(path, self.scratch):
                self.report(f"write {path}")
                raise PermissionError(f"writing {path!r} is not allowed: only the scratch directory is writable")
            if not writes and not self._under(path, self.readable):
                self.report(f"read {path}")
        elif event in WRITE_EVENTS and args:
            # os.symlink / os.link (src, dst): the new name is what is written; os.rename: both ends
            paths = args[1:2] if event in ("os.symlink", "os.link") else args[:2] if event == "os.rename" else args[:1]
            for path in paths:
                if not self._under(path, self.scratch):
                    self.report(f"{event} {path}")
                    raise PermissionError(f"{event} on {path!r} is not allowed: only the scratch directory is writable")
        elif event in READ_EVENTS and args and not self._under(args[0] or ".", self.readable):
            self.report(f"{event} {args[0]}")
        elif event == "import" and args and args[0] in RAW_MODULES and args[0] not in self.imported:
            if self._by_the_code():
                self.imported.add(args[0])
                self.report(f"import {args[0]}")

    @staticmethod
    def _by_the_code():
        """Whether the import statement is the code's own (main.py), not a library's (subprocess, numpy)."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
            frame = frame.f_back
        return frame is not None and frame.f_code.co_filename == "main.py"


def _limit(which, value):
    soft, hard = resource.getrlimit(which)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))


def _apply_limits(limits):
    cpu = int(limits["cpu_seconds"])
    hard_cpu = resource.getrlimit(resource.RLIMIT_CPU)[1]
    if hard_cpu == resource.RLIM_INFINITY or hard_cpu > cpu:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    _limit(resource.RLIMIT_AS, int(limits["memory_bytes"]))
    _limit(resource.RLIMIT_FSIZE, int(limits["file_bytes"]))
    _limit(resource.RLIMIT_NPROC, int(limits["max_processes"]))
    _limit(resource.RLIMIT_NOFILE, 64)


def main():
    settings = json.loads(sys.argv[1])
    with open(sys.argv[2], encoding="utf-8") as f:
        source = f.read()
    sys.argv = ["main.py"]
    sys.path[:0] = settings.get("paths", [])
    try:
        code = compile(source, "main.py", "exec")
    except SyntaxError:
        traceback.print_exc(limit=0)
        sys.exit(1)
    doors = _Doors(settings)
    for fd in range(3, 256):  # nothing of the parent's stays open but the report pipe
        if fd != doors.fd:
            try:
                os.close(fd)
            except OSError:
                pass
    _apply_limits(settings)
    sys.addaudithook(doors)
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as err:  # print the traceback without this file's frames, then fail like Python
        frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename != __file__]
        sys.stderr.write("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
                         + "".join(traceback.format_exception_only(type(err), err)))
        sys.exit(1)


if __name__ == "__main__":
    main()
