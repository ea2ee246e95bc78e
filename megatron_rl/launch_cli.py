"""`megatron-rl wait-ray`: wait for a Ray cluster to assemble (the sbatch script calls it).

    megatron-rl wait-ray --address HOST:PORT --nodes 2 --timeout 300

Exit 0 once `--nodes` Ray nodes are alive at `--address` (logs "ray cluster ready: N nodes"),
1 with one error line when they are not within `--timeout` seconds.
"""

from __future__ import annotations

import argparse
import logging
import time

log = logging.getLogger(__name__)


def wait_for_ray(address: str, nodes: int, timeout: float) -> int:
    """Block until `nodes` Ray nodes are alive at `address`; return how many were seen."""
    import ray

    deadline = time.monotonic() + timeout
    last_err: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if not ray.is_initialized():
                ray.init(address=address, logging_level=logging.WARNING)
            alive = [n for n in ray.nodes() if n["Alive"]]
            if len(alive) >= nodes:
                resources = ray.cluster_resources()
                log.info("ray cluster ready: %d nodes, resources %s", len(alive), resources)
                ray.shutdown()
                return len(alive)
        except ConnectionError as err:  # head not listening yet
            last_err = err
        time.sleep(2)
    raise TimeoutError(f"Ray cluster at {address} did not reach {nodes} nodes in {timeout:.0f} s ({last_err})")


def _cmd_wait_ray(args: argparse.Namespace) -> int:
    from megatron_rl.cli import CommandError
    from megatron_rl.config import ConfigError

    if args.nodes < 1 or args.timeout <= 0:
        raise ConfigError(f"--nodes must be >= 1 and --timeout > 0, got {args.nodes}, {args.timeout}")
    try:
        wait_for_ray(args.address, args.nodes, args.timeout)
    except TimeoutError as err:
        raise CommandError(str(err), exit_code=1) from None
    return 0


def register(sub) -> None:
    p = sub.add_parser("wait-ray", help="wait until a Ray cluster has N alive nodes (used by the sbatch script)")
    p.add_argument("--address", required=True, help="HOST:PORT of the Ray head")
    p.add_argument("--nodes", type=int, required=True, help="how many alive nodes to wait for")
    p.add_argument("--timeout", type=float, default=300, help="seconds before giving up (exit 1)")
    p.set_defaults(func=_cmd_wait_ray)
