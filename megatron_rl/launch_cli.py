"""Small helpers the launch scripts call: waiting for a Ray cluster to assemble.

    python -m megatron_rl.launch_cli wait-ray --address HOST:PORT --nodes 2 --timeout 300
"""

from __future__ import annotations

import argparse
import logging
import sys
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.launch_cli")
    sub = parser.add_subparsers(dest="cmd", required=True)
    wr = sub.add_parser("wait-ray", help="wait until a Ray cluster has N alive nodes")
    wr.add_argument("--address", required=True)
    wr.add_argument("--nodes", type=int, required=True)
    wr.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        wait_for_ray(args.address, args.nodes, args.timeout)
    except TimeoutError as err:
        print(f"wait-ray: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
