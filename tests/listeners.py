"""Which processes listen where: TCP sockets in LISTEN state from /proc/net/tcp and /proc/net/tcp6, each
mapped to the process holding it (its inode among the links in /proc/<pid>/fd).  Linux only.

    for sock in listening(pids={os.getpid()}): print(sock.address, sock.port, sock.pid)
    with RunWatch() as watch:       # tags the CLI runs started inside (MEGATRON_RL_LISTENER_TAG)
        run_cli("train", ...)
    watch.seen                      # every listener a process of those runs held while it ran

The tag travels with a run: its driver inherits this process's environment, a Ray it starts hands the
driver's environment to its workers, a run that joins a running cluster carries MEGATRON_RL_* variables
to its actors in its job's runtime_env (train/run_setup.job_env_vars), and vLLM's engine processes inherit
their actor's.  `also` adds processes that belong to the run without the tag: the shared Ray cluster's
(tests/e2e/conftest.py SHARED_RAY), counted with every process under it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

TAG_ENV = "MEGATRON_RL_LISTENER_TAG"
_LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    pid: int
    name: str = field(compare=False)  # the process's command line when first seen (Ray workers rename themselves)

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port} pid {self.pid} ({self.name})"


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hex_address, 16)))
    words = struct.unpack(">4I", raw)  # four 32-bit words, each in host (little-endian) order
    return socket.inet_ntop(socket.AF_INET6, b"".join(struct.pack("<I", w) for w in words))


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or IPv4-mapped loopback (what an IPv6 socket bound to 127.0.0.1 shows)."""
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def listening_inodes() -> dict[int, tuple[str, int]]:
    """Inode -> (address, port) of every TCP socket listening on this machine (IPv4 and IPv6)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == _LISTEN:
                hex_address, hex_port = fields[1].split(":")
                found[int(fields[9])] = (_address(hex_address), int(hex_port, 16))
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:100].strip()
    except OSError:
        return "?"


def listening(pids) -> list[Listener]:
    """The listening sockets held by the processes `pids`."""
    inodes = listening_inodes()
    out = []
    for pid in pids:
        for inode in _socket_inodes(pid) & inodes.keys():
            address, port = inodes[inode]
            out.append(Listener(address, port, pid, _name(pid)))
    return out


def _parents() -> dict[int, int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def descendants(root: int, parents: dict[int, int] | None = None) -> set[int]:
    """`root` and every process under it."""
    parents = _parents() if parents is None else parents
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, []))
    return out


class RunWatch:
    """Samples, every `interval` seconds while open, the listeners of the processes that carry its tag
    (set in this process's environment while the watch is open: the runs started inside it inherit it)
    and of the processes under `also()` (a pid or None)."""

    def __init__(self, also=lambda: None, interval: float = 0.5):
        self.tag, self.also, self.interval = uuid.uuid4().hex, also, interval
        self.seen: set[Listener] = set()
        self.processes: set[int] = set()  # every tagged process seen
        self._tagged: dict[int, bool] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="listener-watch", daemon=True)

    def _is_tagged(self, pid: int) -> bool:
        if pid not in self._tagged:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                return False  # gone, or not ours to read: asked again next time
            self._tagged[pid] = f"{TAG_ENV}={self.tag}".encode() in environ.split(b"\0")
        return self._tagged[pid]

    def sample(self) -> None:
        parents = _parents()
        pids = {pid for pid in parents if self._is_tagged(pid)}
        self.processes |= pids
        root = self.also()
        if root is not None:
            pids |= descendants(root, parents)
        self.seen.update(listening(pids))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> "RunWatch":
        self._before = os.environ.get(TAG_ENV)
        os.environ[TAG_ENV] = self.tag
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._before is None:
            os.environ.pop(TAG_ENV, None)
        else:
            os.environ[TAG_ENV] = self._before
