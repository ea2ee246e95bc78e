"""Warm CLI runs for the e2e tier: a `megatron-rl` command forked from a Python that imported the CLI's
dependencies once, instead of a fresh Python that imports them again (~6 s of CPU a train run here).

    python -m tests.e2e.warm_cli serve SOCKET    the server: imports PRELOAD, prints "ready", forks a child per
                                                 request; stops when its stdin closes (tests/e2e/conftest.py)
    python -S tests/e2e/warm_cli.py ARGS...      the client, what a test's subprocess runs (stdlib only): the
                                                 server's socket in MEGATRON_RL_WARM_CLI

The client hands the server its stdin, stdout and stderr, ARGS, its environment and working directory; the
child takes them, then runs `megatron_rl.cli.main(ARGS)` and leaves as `python -m megatron_rl.cli ARGS` would
(threads joined, atexit run, the exit code of main or of its exception).  The client forwards the signals a
test sends it to the child and leaves with the child's status (killed by signal N: the client kills itself
with N).  A client that dies (a test's timeout, SIGKILL) takes the child with it: the child watches the
client's connection.

What a forked run does not do as a fresh one does, so a run whose test reads it is started with
`run_cli(..., fresh=True)` (or start_cli): what an import prints goes to the server's stderr, not the run's;
the child's /proc/PID/environ is the server's (its os.environ and what it starts have the run's).  The server
is started with the environment the run's imports read (conftest keys servers by it: RAY_*, HF_*, ...).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

SOCKET_ENV = "MEGATRON_RL_WARM_CLI"
ENTRY_ENV = "MEGATRON_RL_WARM_CLI_ENTRY"  # module:function the child runs instead of megatron_rl.cli:main (tests)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
PRELOAD = (
    "torch",
    "ray",
    "safetensors.torch",
    "megatron_rl.cli",
    "megatron_rl.train.cli",
    "megatron_rl.train.driver",
    "megatron_rl.train.dry_run",
    "megatron_rl.train.roles",
    "megatron_rl.train.run_setup",
    "megatron_rl.models.tiny",
    "transformers.models.llama.modeling_llama",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
)


def _send_request(conn: socket.socket, argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (SOCKET_ENV, ENTRY_ENV)}
    entry = os.environ.get(ENTRY_ENV, "megatron_rl.cli:main")
    payload = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "entry": entry}).encode()
    socket.send_fds(conn, [len(payload).to_bytes(8, "big")], [0, 1, 2])
    conn.sendall(payload)


def _read_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError("the client left before its request was complete")
        data += chunk
    return data


def client(argv: list[str]) -> int:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ[SOCKET_ENV])
    child: list[int] = []
    pending: list[int] = []

    def forward(signum, _frame):
        if child:
            os.kill(child[0], signum)
        else:
            pending.append(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    _send_request(conn, argv)
    answers = conn.makefile("rb")
    first = answers.readline().split()
    if first[:1] != [b"pid"]:
        print(f"warm_cli: the server did not start the run ({first!r})", file=sys.stderr)
        return 1
    child.append(int(first[1]))
    for signum in pending:
        os.kill(child[0], signum)
    last = answers.readline().split()
    if last[:1] == [b"signal"]:
        signum = int(last[1])
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    if last[:1] != [b"exit"]:
        print(f"warm_cli: the server went away before the run ended ({last!r})", file=sys.stderr)
        return 1
    return int(last[1])


def _python_stdio() -> None:
    """sys.stdin/stdout/stderr on fds 0-2 (now the client's), buffered as a fresh Python's would be."""
    import io

    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        mode = "r" if fd == 0 else "w"
        binary = io.open(fd, mode + "b", buffering=0 if unbuffered and fd else -1, closefd=False)
        errors = "backslashreplace" if fd == 2 else "strict"
        text = io.TextIOWrapper(binary, encoding=getattr(sys, name).encoding, errors=errors,
                                line_buffering=fd == 2 or (fd == 1 and os.isatty(1)),
                                write_through=unbuffered and fd != 0)
        setattr(sys, name, text)
        setattr(sys, f"__{name}__", text)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _watch_client(conn: socket.socket) -> None:
    """The client's death (its end closing) ends this run as a fresh process's SIGKILL would."""
    import threading

    def watch():
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="warm-cli-client", daemon=True).start()


def _run_child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: become the run, then leave (never returns)."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (*FORWARDED, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _python_stdio()
        import importlib

        module_name, function = request["entry"].split(":")
        module = importlib.import_module(module_name)
        sys.argv = [module.__file__, *request["argv"]]
        sys.modules["__main__"] = module  # what a spawned helper imports as its main, as under `python -m`
        _watch_client(conn)
        try:
            code = _exit_code(getattr(module, function)(request["argv"]))
        except SystemExit as stop:
            code = _exit_code(stop.code)
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        import atexit
        import threading

        threading._shutdown()  # what Python's finalisation does first: wait for non-daemon threads
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    finally:
        os._exit(code)


def serve(path: str) -> int:
    import importlib
    import select

    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    runs: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener, 0], [], [], 0.2)
        if 0 in ready and not os.read(0, 1024):
            break  # the suite closed our stdin
        if listener in ready:
            conn, _ = listener.accept()
            header, fds, _, _ = socket.recv_fds(conn, 8, 3)
            request = json.loads(_read_exact(conn, int.from_bytes(header, "big")))
            pid = os.fork()
            if pid == 0:
                for other in (listener, *runs.values()):
                    other.close()
                _run_child(conn, request, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"pid {pid}\n".encode())
            runs[pid] = conn
        while runs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = runs.pop(pid, None)
            if conn is None:
                continue
            answer = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
            try:
                conn.sendall(f"{answer}\n".encode())
            except OSError:
                pass  # the client is gone
            conn.close()
    for pid in runs:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    listener.close()
    os.unlink(path)
    return 0


# The variables imports read (torch, Ray's auth mode, Hugging Face, vLLM, threads, paths): runs whose values
# differ get servers of their own (RAY_ADDRESS is read by ray.init, not at import).
IMPORT_ENV = ("RAY_", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "TORCH", "CUDA", "NVIDIA", "VLLM_", "OMP_",
              "MKL_", "PYTHON", "LD_", "PATH", "HOME", "XDG_", "TMP", "WANDB_", "NCCL_", "GLOO_", "LANG", "LC_")


class Servers:
    """The suite's warm servers, one per import environment, started on first need, stopped by `stop()`."""

    def __init__(self, repo) -> None:
        self.repo = repo
        self._servers: dict[tuple, tuple] = {}  # key -> (process, socket path)

    def command(self, args, env: dict) -> tuple[list[str], dict]:
        """The client's command line and environment for `megatron-rl ARGS` under ENV."""
        key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_ENV) and k != "RAY_ADDRESS"))
        if key not in self._servers or self._servers[key][0].poll() is not None:
            self._servers[key] = self._start(env)
        return [sys.executable, "-S", __file__, *args], dict(env, **{SOCKET_ENV: self._servers[key][1]})

    def _start(self, env: dict) -> tuple:
        import subprocess
        import tempfile

        path = os.path.join(tempfile.mkdtemp(prefix="mrl-warm-"), "s")
        proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.warm_cli", "serve", path], cwd=self.repo, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        line = proc.stdout.readline()  # "ready" once PRELOAD is imported and the socket listens; b"" if it died
        if line.strip() != b"ready":
            proc.kill()
            raise RuntimeError(f"the warm CLI server did not start (exit {proc.poll()}, said {line!r})")
        return proc, path

    def stop(self) -> None:
        for proc, _ in self._servers.values():
            if proc.poll() is None:
                proc.stdin.close()
                try:
                    proc.wait(timeout=30)
                except Exception:
                    proc.kill()
        self._servers.clear()


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        sys.exit(serve(sys.argv[2]))
    sys.exit(client(sys.argv[1:]))
