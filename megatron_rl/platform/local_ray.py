"""A Ray cluster this process starts for itself (a run on one node, an eval, an experiment's shared cluster):
every server on loopback, a private token.

    ray.init(num_cpus=n, **local_ray_options())

Addresses.  Ray binds its servers (GCS, raylet and object manager, each worker's RPC server, the autoscaler's
metrics page on port 44217, the runtime-env agent) to loopback only when its node address is a loopback
address, and otherwise to every interface.  Given 127.0.0.1 it puts the node's network address in its place
unless Ray clusters are off for the process: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (Ray's name; Ray reads it
on Linux too).  It is set here for this process and its children (a run that joins this cluster by its
loopback address needs it as well), and in Ray's copy of it, which Ray read at import.  The dashboard
stays off.  A cluster started elsewhere (`ray start`, the Slurm script) is not touched: on several nodes
Ray's servers listen on every interface (Ray has no option to bind one address).

Token.  A cluster ray.init starts turns on Ray's token authentication, and Ray writes the token to
~/.ray/auth_token with the default file mode, readable by every user of the machine.  Here the token is
a private file instead (mode 0600 in a 0700 directory, removed at exit) named by RAY_AUTH_TOKEN_PATH; Ray
processes and clients of this cluster started from this process find it there.  RAY_AUTH_MODE,
RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH set by the user win; a token file others can read
(~/.ray/auth_token, RAY_AUTH_TOKEN_PATH) is made 0600.

Workers' output.  Ray's log monitor forwards what workers write to the drivers (RUN_DIR/logs/ray_<Actor>.log
here) reading at most RAY_LOG_MONITOR_NUM_LINES_TO_READ (1000) lines of a file a pass; once 200 files are
open (a long-lived cluster: a shared one, after about 100 workers) it closes them all between passes, and a
closed file is read again only after it grows.  A burst of more than 1000 lines (an engine's start-up, two
runs at once) then loses its unread part until the actor writes again -- for good when it never does.  So
the monitor of a cluster started here reads each file to its end every pass (FORWARD_ALL; a value the user
sets wins); the Slurm script sets the same for its nodes.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import stat
import sys
import tempfile
from pathlib import Path

from megatron_rl.platform.listen import BIND_ENV, LOOPBACK

logger = logging.getLogger(__name__)

LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
FORWARD_ALL = {"RAY_LOG_MONITOR_NUM_LINES_TO_READ": "1000000"}
"""Ray's log monitor reads every worker file to its end each pass (module docstring, "Workers' output")."""
NODE_LOCAL = (BIND_ENV,)
"""Variables that describe one node (the address its listeners bind): a run's Ray job never carries the
driver's to the workers of other nodes (train/run_setup.job_env_vars)."""


def local_ray_options(environ=os.environ) -> dict:
    """Prepare this process for a Ray cluster of its own (module docstring) and return the ray.init keyword
    arguments that keep it on loopback."""
    environ[LOCAL_ONLY] = "0"
    for name, value in FORWARD_ALL.items():
        environ.setdefault(name, value)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # Ray was imported before: it read the variable already
        constants.ENABLE_RAY_CLUSTER = False
    private_token(environ)
    return {"include_dashboard": False, "dashboard_host": LOOPBACK, "_node_ip_address": LOOPBACK}


def private_token(environ=os.environ) -> Path | None:
    """The token file of a cluster this process starts: a new private one (RAY_AUTH_MODE=token,
    RAY_AUTH_TOKEN_PATH) unless the environment already says how Ray authenticates; its path, or None when
    the environment decides.  Token files others can read are made 0600 first."""
    for path in (Path.home() / ".ray" / "auth_token", environ.get("RAY_AUTH_TOKEN_PATH")):
        if path:
            make_private(Path(path))
    if any(environ.get(name) for name in AUTH_ENV):
        return None
    folder = tempfile.mkdtemp(prefix="megatron_rl_ray_")  # mode 0700
    atexit.register(shutil.rmtree, folder, True)
    path = Path(folder) / "auth_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(path))
    _reload_ray_auth()
    return path


def make_private(path: Path) -> bool:
    """Mode 0600 for a token file that group or others can read; True when it changed."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    if not stat.S_ISREG(mode) or not mode & 0o077:
        return False
    os.chmod(path, 0o600)
    logger.info("token file %s was readable by other users: now mode 0600", path)
    return True


def _reload_ray_auth() -> None:
    """Ray read its auth mode and token when imported: it reads them again (as its own ray.init does when
    it turns token authentication on)."""
    raylet = sys.modules.get("ray._raylet")
    if raylet is None:
        return
    raylet.Config.initialize("")
    raylet.AuthenticationTokenLoader.instance().reset_cache()
