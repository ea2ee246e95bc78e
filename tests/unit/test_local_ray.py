"""A Ray cluster a run starts for itself (issue 44, item 7): its token file is private, and its servers -- the
autoscaler's metrics page among them -- listen on loopback.

    python -m pytest tests/unit/test_local_ray.py -q

`start_ray` of a run on one node runs in a fresh Python (Ray keeps its auth mode and token per process, and
its loopback switch, once set, stays), with ray.init replaced by what ray.init does first for a new cluster:
Ray's token set-up (which writes ~/.ray/auth_token when no token is given) and its choice of the node's
address, which decides where Ray's servers listen -- the autoscaler's metrics page binds 127.0.0.1 when
that address is loopback and every interface otherwise (ray/autoscaler/v2/monitor.py), as do the GCS,
raylet and worker servers.  A real cluster started so: tests/e2e/ray_head.py, whose listeners
tests/e2e/test_streaming.py::test_no_process_of_the_run_listens_beyond_loopback checks.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny_cpu_scratch.yaml"
SCRIPT = """
import json, os, sys
os.umask(0o022)  # a login's usual umask: a file is readable by every user unless made private
import ray
from ray._common.network_utils import is_localhost
from ray._private import services
from ray._private.authentication.authentication_token_setup import (
    enable_token_auth_by_default, ensure_token_if_auth_enabled)
from megatron_rl.train.config import load_train_config
from megatron_rl.train.run_setup import start_ray

seen = {}
def init(address=None, _node_ip_address=None, **kwargs):  # ray.init for a new cluster, up to its processes
    enable_token_auth_by_default()
    ensure_token_if_auth_enabled({}, create_token_if_missing=True)
    ip = services.resolve_ip_for_localhost(_node_ip_address) if _node_ip_address else services.get_node_ip_address()
    seen.update(node_ip=ip, metrics_page_on_loopback=bool(is_localhost(ip)),
                dashboard=kwargs.get("include_dashboard"))
ray.init = init
assert start_ray(load_train_config(sys.argv[1], []))
paths = [os.path.join(os.path.expanduser("~"), ".ray", "auth_token"), os.environ.get("RAY_AUTH_TOKEN_PATH")]
seen["tokens"] = {p: os.stat(p).st_mode & 0o777 for p in paths if p and os.path.isfile(p)}
seen["auth_mode"] = os.environ.get("RAY_AUTH_MODE")
print(json.dumps(seen))
"""


def start_ray_fresh(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MEGATRON_RL_BIND"))}
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(CONFIG)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def readable_by_others(tokens: dict) -> dict:
    return {path: oct(mode) for path, mode in tokens.items() if mode & (stat.S_IRWXG | stat.S_IRWXO)}


def test_a_ray_a_run_starts_keeps_its_token_private_and_its_metrics_page_on_loopback(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    seen = start_ray_fresh(home)
    assert seen["auth_mode"] == "token" and seen["tokens"], seen  # authentication on, with a token file
    assert not readable_by_others(seen["tokens"]), f"token files other users can read: {seen['tokens']}"
    assert not (home / ".ray" / "auth_token").exists()  # a private token of the run's own, not the user's
    assert seen["metrics_page_on_loopback"], (
        f"Ray's node address is {seen['node_ip']}: the autoscaler's metrics page (and every Ray server) "
        "would listen on all interfaces")
    assert seen["dashboard"] is False


def test_a_token_file_an_earlier_ray_left_readable_is_made_private(tmp_path):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    token = home / ".ray" / "auth_token"
    token.write_text("0" * 64)
    token.chmod(0o644)  # as Ray 2.60 writes it
    seen = start_ray_fresh(home)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert not readable_by_others(seen["tokens"]), seen["tokens"]


def test_a_cluster_started_here_forwards_each_worker_file_to_its_end_unless_the_user_says_otherwise(monkeypatch):
    from megatron_rl.platform.local_ray import FORWARD_ALL, local_ray_options

    monkeypatch.delitem(sys.modules, "ray._private.ray_constants", raising=False)  # this process's Ray is left as is

    ours = {"RAY_AUTH_MODE": "token"}  # the user's auth: no token file made here
    local_ray_options(ours)
    assert ours["RAY_LOG_MONITOR_NUM_LINES_TO_READ"] == FORWARD_ALL["RAY_LOG_MONITOR_NUM_LINES_TO_READ"]
    assert int(ours["RAY_LOG_MONITOR_NUM_LINES_TO_READ"]) >= 100_000
    theirs = {"RAY_AUTH_MODE": "token", "RAY_LOG_MONITOR_NUM_LINES_TO_READ": "500"}
    local_ray_options(theirs)
    assert theirs["RAY_LOG_MONITOR_NUM_LINES_TO_READ"] == "500"
