"""Where the project's own listeners bind: loopback when the run is on one node, the node's address on the
cluster network when it spans several, never a wildcard (0.0.0.0, ::).

    host = bind_address()                          # 127.0.0.1, MEGATRON_RL_BIND_ADDRESS, or this node's Ray address
    store = listening_store(host, world_size)      # a TCPStore master listening on `host` alone (store.port)
    pin_gloo(host)                                 # this process's gloo sockets on the interface holding `host`

The address (`bind_address`): MEGATRON_RL_BIND_ADDRESS when set (the Slurm script sets it on every node to
that node's address on the cluster network, CLUSTER_IFACE); else 127.0.0.1 when Ray is not up here or its
cluster has one node (everything of the run is on this node); else the address Ray knows this node by.

torch's TCPStore does not listen on the host it is given: its server binds every interface (`::`), so a
client anywhere on the network could read the rendezvous keys.  `listening_store` binds the socket itself
and hands it to the store (`master_listen_fd`).  Gloo listens on the address its host name resolves to
unless GLOO_SOCKET_IFNAME names an interface; `pin_gloo` names the one holding the address.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import socket
import struct
from pathlib import Path

LOOPBACK = "127.0.0.1"
BIND_ENV = "MEGATRON_RL_BIND_ADDRESS"
"""An explicit address for this node's listeners (node-local: a run's job does not carry it to other nodes)."""
GLOO_ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_IFF_LOOPBACK = 0x8


def is_wildcard(address: str) -> bool:
    """True for an address that listens on every interface (0.0.0.0, ::, an empty host, "*")."""
    text = address.strip().strip("[]")
    try:
        return ipaddress.ip_address(text).is_unspecified
    except ValueError:
        return text in ("", "*")


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback (::ffff:127.0.0.1) and "localhost"."""
    text = address.strip().strip("[]")
    if text == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _checked(address: str, what: str) -> str:
    if is_wildcard(address):
        raise ValueError(f"{what} is {address!r}, which listens on every interface: name one address "
                         "(127.0.0.1 on one node, the node's address on the cluster network on several)")
    return address


def choose_bind_address(explicit: str | None, nodes: int, node_ip: str | None) -> str:
    """The address of `bind_address`: `explicit` (MEGATRON_RL_BIND_ADDRESS) when given, loopback for a run on
    one node (`nodes` <= 1), else `node_ip` (this node's address in the Ray cluster).  Never a wildcard."""
    if explicit is not None and explicit.strip():
        return _checked(explicit.strip(), BIND_ENV)
    if nodes <= 1:
        return LOOPBACK
    if not node_ip:
        raise ValueError(f"the Ray cluster has {nodes} nodes and this one has no address: set {BIND_ENV}")
    return _checked(node_ip, "this node's Ray address")


def bind_address(environ=os.environ) -> str:
    """Where this process's listeners bind (module docstring); asks Ray for its nodes when it is up."""
    explicit = environ.get(BIND_ENV)
    if explicit is not None and explicit.strip():
        return choose_bind_address(explicit, 1, None)
    import ray

    if not ray.is_initialized():
        return LOOPBACK
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    return choose_bind_address(None, nodes, ray.util.get_node_ip_address() if nodes > 1 else None)


def listening_store(host: str, world_size: int, timeout_s: float = 600.0, port: int = 0):
    """A TCPStore master listening on `host` alone, on `port` (0: one the OS picks while binding, so no
    other process can take it before the store listens; `store.port` says which)."""
    import torch.distributed as dist

    _checked(host, "the store's host")
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, where = min(found, key=lambda info: info[0] != socket.AF_INET)  # a name: its IPv4 first
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(socket.SOMAXCONN)
        store = dist.TCPStore(host, sock.getsockname()[1], world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the socket now (it closes it with the store)
    return store


def joining_store(host: str, port: int, world_size: int, timeout_s: float = 600.0):
    """A TCPStore client of the master listening at host:port (`listening_store`, in another process); it waits
    up to timeout_s for the master to answer."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _loopback_interface() -> str:
    for _, name in socket.if_nameindex():
        try:
            flags = int(Path(f"/sys/class/net/{name}/flags").read_text().strip(), 16)
        except (OSError, ValueError):
            continue
        if flags & _IFF_LOOPBACK:
            return name
    return "lo"


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """The name of this machine's interface that holds `address` (any loopback address: the loopback
    interface; else IPv4, a host name resolved); None when no interface here holds it."""
    try:
        ip = ipaddress.ip_address(address.strip().strip("[]"))
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(address))
        except (OSError, ValueError):
            return None
    if is_loopback(str(ip)):
        return _loopback_interface()
    if ip.version != 4:
        return None
    return next((name for _, name in socket.if_nameindex() if _ipv4_of(name) == str(ip)), None)


def pin_gloo(host: str, environ=os.environ) -> str | None:
    """Gloo's sockets of this process (every gloo group it makes from now on) on the interface holding
    `host` -- the address it listens on, or its peer's when that one is on this node (loopback: the whole
    run is here) -- else on the interface of MEGATRON_RL_BIND_ADDRESS.  Returns the interface; nothing
    changes when GLOO_SOCKET_IFNAME is set already or neither address is on this node."""
    if environ.get(GLOO_ENV):
        return environ[GLOO_ENV]
    for address in (host, environ.get(BIND_ENV)):
        iface = interface_of(address) if address else None
        if iface:
            environ[GLOO_ENV] = iface
            return iface
    return None
