"""Hostile code through the `python` environment's sandbox (issue 44): each snippet an adversarial tester ran
against the old sandbox, plus a fork bomb.  Each test asserts containment on the host's side (the file is
not there, the listener got no connection, no process outlived the call, the secret never came back) and
that the episode's observation and counters say what happened (tool_errors, sandbox_violations).

    python -m pytest tests/security -q

Several snippets go around the interpreter's audit hook on purpose (_posixsubprocess.fork_exec, _ctypes):
what stops them is bubblewrap's namespaces, mounts, uid and seccomp filter, so these tests fail on the
old subprocess sandbox (`sandbox.isolation: weak`; test_weak_isolation_lets_the_bypasses_through shows it).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import pytest

import megatron_rl
from megatron_rl.envs.example import Example
from megatron_rl.envs.python_tool import PythonConfig, PythonEnvironment
from megatron_rl.envs.sandbox import Sandbox, SandboxConfig

LIMITS = dict(cpu_seconds=2, wall_seconds=4.0, memory_mb=256, output_bytes=4000, scratch_mb=16, max_processes=16)
SECRET = "hunter2-" + secrets.token_hex(6)
FORK_EXEC = """
import _posixsubprocess, os
def spawn(argv, setsid=False):
    args = [a.encode() for a in argv]
    r, w = os.pipe(); er, ew = os.pipe()
    pid = _posixsubprocess.fork_exec(args, args, True, (w,), None, None, -1, -1, -1, w, -1, w, er, ew,
                                     False, setsid, -1, None, None, -1, -1, None, False)
    os.close(w); os.close(ew)
    return pid, r
"""
LIBC = """
import _ctypes, ctypes
_h = _ctypes.dlopen("libc.so.6", 2)
def libc(name, *args):
    return ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_long] * len(args))(_ctypes.dlsym(_h, name))(*args)
"""


class Host:
    """What the host holds that the code must not reach: files, listeners, a planted secret."""

    def __init__(self, root: Path):
        self.outside = root / "other_user"
        self.outside.mkdir()
        (self.outside / "secret.txt").write_text(SECRET)
        os.chmod(self.outside / "secret.txt", 0o644)
        self.connections: list[str] = []
        self.tcp = socket.socket()
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen()
        self.unix_path = str(self.outside / "host.sock")
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        self.unix.listen()
        for s in (self.tcp, self.unix):
            threading.Thread(target=self._accept, args=(s,), daemon=True).start()
        self.purelib = Path(sysconfig.get_paths()["purelib"])
        self.package = Path(megatron_rl.__file__).parent

    def _accept(self, s: socket.socket) -> None:
        while True:
            try:
                conn, _ = s.accept()
            except OSError:
                return
            self.connections.append(str(s.getsockname()))
            conn.close()

    def close(self) -> None:
        self.tcp.close()
        self.unix.close()


@pytest.fixture(scope="module")
def host():
    # not under /tmp: the sandbox has a /tmp of its own, so a host path there would only look missing
    root = Path(tempfile.mkdtemp(prefix="mrl-host-", dir="/var/tmp" if os.path.isdir("/var/tmp") else Path.home()))
    h = Host(root)
    os.environ["MEGATRON_RL_PLANTED_SECRET"] = SECRET  # the trainer's environment: the code must not see it
    yield h
    os.environ.pop("MEGATRON_RL_PLANTED_SECRET", None)
    h.close()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def env():
    env = PythonEnvironment(PythonConfig(sandbox=SandboxConfig(**LIMITS)))
    assert env.sandbox.isolation == "bwrap", "the default sandbox is bubblewrap; CI installs it (launch/install.sh)"
    env.reset(Example(id="p", question="What is 6 * 7?", answer="42"))
    return env


def step(env, code: str):
    """One tool call of the policy; the observation, its info counters and the run's seconds."""
    call = "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"
    result = env.step(call)
    assert not result.done and result.reward is None
    return result.observation, result.info


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def _processes_with(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            found.append(f"{pid}: {cmd}")
    return found


# --- reading what is not the code's ---------------------------------------------------------------------------

def test_etc_passwd_is_not_there(env):
    obs, info = step(env, "print(open('/etc/passwd').read())")
    assert "root:" not in obs and "FileNotFoundError" in obs
    assert info["tool_errors"] == 1 and info["sandbox_violations"] >= 1


def test_roots_home_shows_only_the_interpreters_path(env):
    obs, info = step(env, "import os\nfor p in ('/root', os.path.expanduser('~root')):\n    print(sorted(os.listdir(p)))")
    on_host = set(os.listdir("/root")) if os.access("/root", os.R_OK) else set()
    leaked = [name for name in on_host - {".pyenv"} if f"'{name}'" in obs]
    assert not leaked, obs
    assert info["sandbox_violations"] >= 1


def test_another_users_file_is_not_there(env, host):
    obs, info = step(env, f"print(open({str(host.outside / 'secret.txt')!r}).read())")
    assert SECRET not in obs and "FileNotFoundError" in obs
    assert info["sandbox_violations"] >= 1


def test_the_trainers_environment_and_other_processes_environments_stay_hidden(env, host):
    code = ("import os\nprint(dict(os.environ))\nfor pid in os.listdir('/proc'):\n    if pid.isdigit():\n"
            "        try:\n            print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
            "        except OSError as e:\n            print(pid, e)\n"
            f"print(open('/proc/{os.getpid()}/cmdline').read())")
    obs, info = step(env, code)
    assert SECRET not in obs
    assert "MEGATRON_RL" not in obs and "PATH" in obs  # scrubbed to the sandbox's own few variables
    assert "FileNotFoundError" in obs  # the test process's pid does not exist in the sandbox's PID namespace


def test_a_symlink_or_proc_root_does_not_lead_out(env, host):
    code = ("import os\nos.symlink('/etc', 'e')\nfor p in ('e/passwd', '/proc/1/root/etc/passwd', "
            f"'/proc/self/root{host.outside / 'secret.txt'}'):\n    try:\n        print(open(p).read())\n"
            "    except OSError as err:\n        print(type(err).__name__, p)")
    obs, _ = step(env, code)
    assert "root:" not in obs and SECRET not in obs
    assert obs.count("Error") >= 3, obs


def test_no_descriptor_of_the_trainer_is_inherited(env, host):
    held = open(host.outside / "secret.txt")  # the trainer holds files and sockets open
    try:
        obs, _ = step(env, "import os\nfor fd in os.listdir('/proc/self/fd'):\n"
                           "    try:\n        print(fd, os.readlink(f'/proc/self/fd/{fd}'))\n"
                           "    except OSError:\n        pass")
    finally:
        held.close()
    targets = [line.split(" ", 1)[1] for line in obs.splitlines()[:-1] if " " in line]
    assert targets and all(t.startswith(("pipe:", "/dev/null", "/proc/")) for t in targets), obs


# --- writing where the trainer can --------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["outside", "sitecustomize", "pth", "project_package", "usr"])
def test_writes_outside_scratch_fail_and_leave_nothing(env, host, where):
    target = {"outside": host.outside / "pwned.txt", "sitecustomize": host.purelib / "sitecustomize.py",
              "pth": host.purelib / "zz_pwned.pth", "project_package": host.package / "__init__.py",
              "usr": Path("/usr/lib/pwned.txt")}[where]
    before = _digest(target)
    code = (f"import os\npath = {str(target)!r}\ntry:\n    open(path, 'a').write('import os; os.system(\"id\")\\n')\n"
            "except OSError as err:\n    print('open:', type(err).__name__)\n"
            "try:\n    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)\n    os.write(fd, b'x')\n"
            "except OSError as err:\n    print('os.open:', type(err).__name__)\n")
    obs, info = step(env, code)
    assert _digest(target) == before, f"{target} changed: {obs}"
    if str(target).startswith("/tmp/"):  # a checkout under /tmp: the sandbox's own /tmp hides the host's path
        assert "open: FileNotFoundError" in obs and "os.open: FileNotFoundError" in obs, obs
        return
    assert "open: PermissionError" in obs and "os.open: PermissionError" in obs
    assert info["sandbox_violations"] >= 2


def test_a_write_around_the_hook_meets_a_read_only_or_missing_file(env, host):
    target = host.package / "__init__.py"
    before = _digest(target)
    code = LIBC + (f"p = ctypes.create_string_buffer({str(target).encode()!r})\n"
                   "fd = libc('open', ctypes.addressof(p), 0o2 | 0o100 | 0o2000, 0o644)\n"
                   "print('fd', fd, 'errno', ctypes.get_errno())\n"
                   "u = ctypes.create_string_buffer(b'/usr/lib/pwned-raw')\n"
                   "print('usr', libc('open', ctypes.addressof(u), 0o1 | 0o100, 0o644))")
    obs, info = step(env, code)
    assert _digest(target) == before and not Path("/usr/lib/pwned-raw").exists()
    assert "usr -1" in obs, obs
    if not str(target).startswith("/tmp/"):  # under /tmp the sandbox's own tmpfs takes the path (nothing leaves)
        assert "fd -1" in obs, obs
    assert info["sandbox_violations"] >= 1  # the code's own `import _ctypes`


def test_scratch_is_size_limited_and_shm_is_private(env):
    marker = "mrl-" + secrets.token_hex(4)
    code = (f"n = 0\ntry:\n    while n < 64:\n        open(f'/tmp/fill{{n}}', 'wb').write(b'x' * (1 << 20))\n"
            f"        n += 1\nexcept OSError as err:\n    print('stopped', n, err.strerror)\n"
            f"open('/dev/shm/{marker}', 'wb').write(b'y' * (4 << 20))\nprint('shm written')")
    obs, _ = step(env, code)
    assert "stopped" in obs and "No space left on device" in obs and "shm written" in obs, obs
    written = int(obs.split("stopped ")[1].split()[0])
    assert written <= LIMITS["scratch_mb"], obs
    assert not any(marker in name for name in os.listdir("/dev/shm"))  # died with the call


# --- processes, signals, the kernel -------------------------------------------------------------------------

def test_fork_exec_around_the_hook_runs_as_a_non_root_uid_in_its_own_pid_namespace(env):
    obs, info = step(env, FORK_EXEC + "pid, r = spawn(['/usr/bin/id'])\nos.waitpid(pid, 0)\n"
                                      "print(os.read(r, 200).decode(), 'pid', os.getpid())")
    assert "uid=" in obs and "uid=0" not in obs, obs
    assert "pid 2" in obs or "pid 3" in obs  # bubblewrap is PID 1 of the sandbox
    assert info["sandbox_violations"] >= 1  # `import _posixsubprocess` by the code itself


def test_the_parent_cannot_be_signalled(env):
    obs, _ = step(env, "import os, signal\nfor how in ('pidfd', 'kill'):\n    try:\n"
                       "        if how == 'pidfd':\n            signal.pidfd_send_signal(os.pidfd_open(os.getppid()), 9)\n"
                       "        else:\n            os.kill(os.getppid(), 9)\n        print(how, 'sent')\n"
                       "    except OSError as err:\n        print(how, type(err).__name__)\n"
                       + LIBC + f"print('host pid', libc('kill', {os.getpid()}, 9))")
    assert "sent" not in obs and "host pid -1" in obs, obs
    obs, _ = step(env, "print('still here')")  # the sandbox (and this process) survived
    assert obs.startswith("still here")


@pytest.mark.parametrize("name, call", [("unshare", "libc('syscall', 272, 0x10000000)"),
                                        ("mount", "libc('syscall', 165, 0, 0, 0, 0, 0)"),
                                        ("ptrace", "libc('syscall', 101, 0, 0, 0, 0)"),
                                        ("bpf", "libc('syscall', 321, 0, 0, 0)")])
def test_kernel_attack_surface_is_filtered(env, name, call):
    import platform
    if platform.machine() != "x86_64":
        pytest.skip("the syscall numbers in this test are x86_64's")
    obs, _ = step(env, LIBC + f"print('{name}', {call}, ctypes.get_errno())")
    assert f"{name} -1" in obs, obs


def test_processes_are_limited_even_around_the_hook(env):
    obs, _ = step(env, FORK_EXEC + "n = 0\ntry:\n    for _ in range(40):\n        spawn(['/bin/sleep', '3'])\n"
                                   "        n += 1\nexcept OSError as err:\n    print('refused', type(err).__name__)\n"
                                   "print('started', n)")
    started = int(obs.split("started ")[1].split()[0])
    assert started < LIMITS["max_processes"] and "refused" in obs, obs


def test_threads_count_against_the_process_limit(env):
    obs, _ = step(env, "import threading, time\nts = []\ntry:\n    for _ in range(100):\n"
                       "        t = threading.Thread(target=time.sleep, args=(1,)); t.start(); ts.append(t)\n"
                       "except RuntimeError as err:\n    print('stopped at', len(ts), err)")
    assert "can't start new thread" in obs, obs


def test_a_fork_bomb_is_contained_and_nothing_survives_the_call(env):
    marker = "4." + str(secrets.randbelow(10 ** 6))
    start = time.monotonic()
    obs, info = step(env, FORK_EXEC + f"spawn(['/bin/sh', '-c', 'sleep {marker}'], setsid=True)\n"
                                      "spawn(['/bin/sh', '-c', 'b() { b | b & }; b'])\nimport time\ntime.sleep(30)")
    assert time.monotonic() - start < LIMITS["wall_seconds"] + 3
    assert "[killed: wall-clock limit" in obs and info["tool_errors"] == 1
    deadline = time.monotonic() + 3
    while _processes_with(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _processes_with(f"sleep {marker}")  # the setsid grandchild died with the sandbox


def test_limits_of_the_old_sandbox_still_hold(env):
    for code, expected in [("while True:\n    pass", "[killed: CPU time limit of 2 s]"),
                           ("x = bytearray(1 << 30)", "MemoryError"),
                           ("while True:\n    print('y' * 1000)", "[killed: output passed 32000 bytes]"),
                           ("import os\nos.system('id')", "PermissionError: os.system is not allowed"),
                           ("import subprocess\nsubprocess.run(['id'])", "PermissionError: subprocess.Popen"),
                           ("import os\nos.fork()", "PermissionError: os.fork is not allowed"),
                           ("import multiprocessing\nmultiprocessing.Process(target=print).start()", "PermissionError"),
                           ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (-1, -1))", "ValueError")]:
        obs, info = step(env, code)
        assert expected in obs, (code, obs)
        assert info["tool_errors"] == 1


# --- the network and the host's sockets ---------------------------------------------------------------------

def test_no_host_network_and_no_host_unix_socket(env, host):
    port = host.tcp.getsockname()[1]
    code = ("import os, _socket\n"
            f"print('unix path', os.path.exists({host.unix_path!r}), os.path.exists('/tmp/ray'))\n"
            "try:\n    s = _socket.socket()\n"
            f"    s.connect(('127.0.0.1', {port}))\nexcept OSError as err:\n    print('hook', type(err).__name__)\n"
            + LIBC + "s = libc('socket', 2, 1, 0)\n"
            f"addr = ctypes.create_string_buffer(bytes([2, 0, {port >> 8}, {port & 255}, 127, 0, 0, 1]) + bytes(8))\n"
            "print('raw connect', libc('connect', s, ctypes.addressof(addr), 16))\n"
            f"u = libc('socket', 1, 1, 0)\nua = ctypes.create_string_buffer(b'\\x01\\x00' + {host.unix_path.encode()!r})\n"
            "print('raw unix', libc('connect', u, ctypes.addressof(ua), 110))\n"
            "print(open('/proc/net/dev').read())")
    obs, info = step(env, code)
    time.sleep(0.2)
    assert host.connections == [], host.connections
    assert "unix path False False" in obs and "raw connect -1" in obs and "raw unix -1" in obs, obs
    interfaces = [line.split(":")[0].strip() for line in obs.splitlines() if ":" in line and "|" not in line
                  and line.strip().split(":")[0].strip().isidentifier()]
    assert set(interfaces) <= {"lo"}, obs
    assert info["sandbox_violations"] >= 1


# --- the old sandbox, for contrast --------------------------------------------------------------------------

def test_weak_isolation_lets_the_bypasses_through_and_says_so(host, caplog):
    """What these tests would see without bubblewrap: this is why `weak` must be asked for by name."""
    with caplog.at_level("WARNING"):
        box = Sandbox(SandboxConfig(**LIMITS, isolation="weak"))
    assert box.isolation.startswith("weak") and "isolation is 'weak'" in caplog.text
    run = box.run(f"print(open({str(host.outside / 'secret.txt')!r}).read())")
    assert SECRET in run.output and run.violations  # read, and flagged: but nothing stopped it


def test_each_call_gets_its_own_control_group_with_memory_and_process_limits():
    """Where the host lets us create control groups (CI's machine does), the call runs inside one with
    pids.max and a memory limit that counts tmpfs and shm, and the group is gone after the call."""
    from megatron_rl.envs import cgroups

    if not cgroups.available():
        pytest.skip("this host lets us create no control group (rlimits and tmpfs sizes still hold)")
    box = Sandbox(SandboxConfig(**LIMITS))
    seen: dict[str, str] = {}

    wanted = {c for c in cgroups.controllers() if c in ("pids", "memory")}

    def watch():  # until every limited controller's group was seen (cgroup v1: one group per controller, made in turn)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not wanted <= {key.split(":")[0] for key in seen}:
            for controller, base in cgroups.controllers().items():
                for group in base.glob(f"megatron-rl-sandbox-{os.getpid()}-*"):
                    for name in ("pids.max", "memory.max", "memory.limit_in_bytes"):
                        if (group / name).exists():
                            seen[f"{controller}:{name}"] = (group / name).read_text().strip()
            time.sleep(0.02)
    thread = threading.Thread(target=watch)
    thread.start()
    run = box.run("import time\ntime.sleep(1.5)\nprint('done')")
    thread.join()
    assert run.output.startswith("done")
    limits = {key.split(":")[1]: value for key, value in seen.items()}
    if "pids" in cgroups.controllers():
        assert limits.get("pids.max") == str(LIMITS["max_processes"] + 2), seen
    if "memory" in cgroups.controllers():
        memory = limits.get("memory.max") or limits.get("memory.limit_in_bytes")
        assert memory == str((LIMITS["memory_mb"] + 2 * LIMITS["scratch_mb"]) << 20), seen
    leftovers = [g for base in cgroups.controllers().values() for g in base.glob(f"megatron-rl-sandbox-{os.getpid()}-*")]
    assert not leftovers, leftovers
