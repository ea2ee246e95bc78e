"""The suite's one Ray cluster (tests/e2e/conftest.py starts it once per pytest session, on first need).

    python -m tests.e2e.ray_head      # prints {"address": GCS_ADDRESS, "env": {...}}, serves until stdin closes

This process owns the cluster, as `megatron-rl experiment`'s runner owns its shared one: its workers get
this process's environment (PYTHONPATH holds the checkout, so actors import test doubles from tests/), and
the cluster stops when stdin closes, at the session's end or when pytest dies.  CLI runs join it with
`run.use_existing_ray=true` and RAY_ADDRESS; each is its own Ray job, so its actors and placement groups
go when its driver exits.
"""

from __future__ import annotations

import json
import logging
import os
import sys


def main() -> int:
    import ray

    from megatron_rl.platform.local_ray import LOCAL_ONLY, local_ray_options

    # Started as a run on one node starts its own (train/run_setup.start_ray): every server on loopback, a
    # private token.  A client must ask for token authentication, know where the token is and take the
    # cluster's loopback address as it is, so those variables go out with the address.
    ray.init(logging_level=logging.WARNING, log_to_driver=False, **local_ray_options())
    env = {k: v for k, v in os.environ.items() if k.startswith("RAY_AUTH_") or k == LOCAL_ONLY}
    print(json.dumps({"address": ray.get_runtime_context().gcs_address, "env": env}), flush=True)
    sys.stdin.read()  # until the suite closes our stdin (or dies)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
