"""What the project listens on (issue 44, item 7): the learner's rendezvous store on loopback when the run is
on one node, on the node's cluster address when it spans several, never on every interface; the bind
address chosen; a listener seen by the /proc reader the end-to-end check uses (tests/listeners.py).

    python -m pytest tests/unit/test_listeners.py -q

A Ray the project starts itself (token file, the autoscaler's metrics page): tests/unit/test_local_ray.py.
The listeners of a whole run: tests/e2e/test_streaming.py::test_no_process_of_the_run_listens_beyond_loopback.
"""

from __future__ import annotations

import os
import socket

import pytest
import ray

from megatron_rl.ranks.build import Rendezvous
from tests.listeners import listening

pytestmark = pytest.mark.unit

BIND_ENV = "MEGATRON_RL_BIND_ADDRESS"


def node_address() -> str | None:
    """This machine's address on its network (the interface a route to a public address leaves by), or None
    where it has only loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent
        except OSError:
            return None
        address = sock.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.fixture
def cluster(monkeypatch):
    """Ray, as the learner rank sees it: up, with `nodes` alive nodes, this one at `node_ip`."""
    state = {"nodes": 1, "node_ip": node_address() or "127.0.0.1"}
    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}] * state["nodes"] + [{"Alive": False}])
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: state["node_ip"])
    return state


def store_listeners(port: int) -> list:
    return [sock for sock in listening({os.getpid()}) if sock.port == port]


def rendezvous_binds() -> tuple[str, list[str]]:
    """Rank 0's rendezvous: the address it tells the other ranks, and where its store listens."""
    rdv = Rendezvous(0, 2)
    host, port = rdv.address()
    try:
        return host, [sock.address for sock in store_listeners(port)]
    finally:
        rdv.store = None  # the store closes its socket


def test_the_rendezvous_store_of_a_run_on_one_node_listens_on_loopback_only(cluster):
    host, bound = rendezvous_binds()
    assert host == "127.0.0.1"
    assert bound == ["127.0.0.1"], f"the learner's TCPStore listens on {bound} (a client from the network reads it)"


def test_the_rendezvous_store_of_a_run_on_several_nodes_listens_on_the_node_address(cluster):
    address = node_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    cluster["nodes"] = 2
    host, bound = rendezvous_binds()
    assert host == address and bound == [address], bound


def test_the_address_the_slurm_script_names_wins_and_a_wildcard_is_refused(cluster, monkeypatch):
    cluster["nodes"] = 2
    monkeypatch.setenv(BIND_ENV, "127.0.0.2")  # the node's address on the cluster network, as the script sets it
    host, bound = rendezvous_binds()
    assert host == "127.0.0.2" and bound == ["127.0.0.2"], bound
    for wildcard in ("0.0.0.0", "::", "[::]"):
        monkeypatch.setenv(BIND_ENV, wildcard)
        with pytest.raises(ValueError, match="every interface"):
            Rendezvous(0, 2).address()


def test_the_bind_address_single_node_multi_node_and_explicit():
    from megatron_rl.platform.listen import choose_bind_address, is_loopback, is_wildcard

    assert choose_bind_address(None, 1, "10.1.2.3") == "127.0.0.1"  # one node: loopback, whatever Ray says
    assert choose_bind_address(None, 0, None) == "127.0.0.1"  # no Ray here
    assert choose_bind_address(None, 4, "10.1.2.3") == "10.1.2.3"
    assert choose_bind_address(" 10.9.0.7 ", 4, "10.1.2.3") == "10.9.0.7"  # MEGATRON_RL_BIND_ADDRESS
    assert choose_bind_address("10.9.0.7", 1, None) == "10.9.0.7"
    for bad in [("0.0.0.0", 1, None), (None, 2, "0.0.0.0"), (None, 2, "::"), (None, 3, None)]:
        with pytest.raises(ValueError):
            choose_bind_address(*bad)
    assert all(map(is_wildcard, ["0.0.0.0", "::", "[::]", "", "*"])) and not is_wildcard("127.0.0.1")
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.1.2.3", "::ffff:10.1.2.3"]))


def test_gloo_is_pinned_to_the_interface_holding_the_address(monkeypatch):
    from megatron_rl.platform.listen import interface_of, pin_gloo

    lo = interface_of("127.0.0.1")
    assert lo and interface_of("::1") == lo and interface_of("203.0.113.9") is None
    env = {}
    assert pin_gloo("127.0.0.1", env) == lo and env == {"GLOO_SOCKET_IFNAME": lo}
    env = {"GLOO_SOCKET_IFNAME": "ib0"}
    assert pin_gloo("127.0.0.1", env) == "ib0"  # the user's choice stands
    env = {BIND_ENV: "127.0.0.5"}  # a peer on another node: this node's named address decides
    assert pin_gloo("203.0.113.9", env) == lo
    env = {}
    assert pin_gloo("203.0.113.9", env) is None and env == {}


def test_the_slurm_script_names_each_nodes_address_and_a_run_keeps_it_on_its_node():
    import re
    import shutil
    import subprocess

    from megatron_rl.slurm_scripts import train_script
    from megatron_rl.train.run_setup import job_env_vars

    script = train_script()
    code = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code if "0.0.0.0" in line]
    assert 'export MEGATRON_RL_BIND_ADDRESS="$head_ip"' in script  # the head's Ray and the driver
    assert '--node-ip-address="$head_ip"' in script and '--node-ip-address="$addr"' in script  # every node's Ray
    assert 'MEGATRON_RL_BIND_ADDRESS="$addr" exec' in script  # the workers' (each node's own)
    # The driver's address stays on its node: a run's job does not hand it to the actors on the others.
    assert job_env_vars({"MEGATRON_RL_DRILL": "x", BIND_ENV: "10.0.0.1", "PATH": "/bin"}) == {"MEGATRON_RL_DRILL": "x"}
    helper = re.search(r"^export CLUSTER_IFACE=.*?^export -f node_address$", script, re.S | re.M).group(0)
    for iface, expect in [("", None), ("lo", "127.0.0.1")]:
        if iface and shutil.which("ip") is None:
            continue
        out = subprocess.run(["bash", "-c", f"set -euo pipefail; {helper}\nnode_address; echo \"${{GLOO_SOCKET_IFNAME:-}}\""],
                             env={"PATH": os.environ["PATH"], "CLUSTER_IFACE": iface}, capture_output=True,
                             text=True, check=True).stdout.split("\n")
        address, gloo = out[0], out[1]
        assert address and not address.startswith(("0.0.0.0", "::")) and (expect is None or address == expect)
        assert gloo == iface  # gloo on the named interface (none named: gloo's own choice)
