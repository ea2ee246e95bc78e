"""The sandbox's child side: limits itself, closes the doors, then runs the policy's code.

    python -I -B -u sandbox_child.py LIMITS_JSON CODE_FILE     # started by sandbox.Sandbox.run only

1. resource limits on this process (inherited by anything it could start): CPU seconds
   (RLIMIT_CPU: SIGXCPU, then SIGKILL one second later), address space (RLIMIT_AS: a large
   allocation raises MemoryError), file size (RLIMIT_FSIZE), processes (RLIMIT_NPROC, which the
   kernel does not enforce for root) and open files;
2. an audit hook (PEP 578; it cannot be removed once added) that refuses process creation
   (fork, exec, spawn, system, subprocess), sockets, and ctypes symbol look-ups (which could
   call fork or socket directly) with PermissionError;
3. the code runs as `__main__`; a traceback shows only the policy's own frames.

The hook is a best-effort layer inside the interpreter (a C extension the code imports could go
around it); the parent adds what the kernel enforces: a network namespace without interfaces
when `unshare` can make one, a new session killed as a whole at the wall-clock limit, and the
output cap.  This file imports nothing from the project (it runs outside it).
"""

import json
import resource
import sys
import traceback

BLOCKED_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill", "os.killpg",
    "subprocess.Popen", "pty.spawn", "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
    "socket.sendto", "ctypes.dlsym", "ctypes.cdata",
})  # ctypes.dlopen stays allowed: numpy imports ctypes; looking up a C function (dlsym) is refused


def _refuse(event, args):
    if event in BLOCKED_EVENTS:
        raise PermissionError(f"{event} is not allowed in the sandbox (no processes, no network)")


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
    limits = json.loads(sys.argv[1])
    with open(sys.argv[2], encoding="utf-8") as f:
        source = f.read()
    sys.argv = ["main.py"]
    try:
        code = compile(source, "main.py", "exec")
    except SyntaxError:
        traceback.print_exc(limit=0)
        sys.exit(1)
    _apply_limits(limits)
    sys.addaudithook(_refuse)
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
