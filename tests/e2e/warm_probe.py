"""A test double for tests/e2e/test_warm_cli.py: the entry a warm child runs instead of megatron_rl.cli:main,
doing what its first argument says (reporting what the run was given, exiting in each way, waiting for
signals), so the harness's semantics are checked without a training run."""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time


def main(argv: list[str]) -> int:
    what = argv[0]
    if what == "report":
        print(json.dumps({"argv": argv, "cwd": os.getcwd(), "probe": os.environ.get("WARM_PROBE"),
                          "server_only": os.environ.get("WARM_PROBE_SERVER_ONLY"), "stdin": sys.stdin.read(),
                          "main": sys.modules["__main__"].__name__}))
        print("to stderr", file=sys.stderr)
        return 0
    if what == "exit":
        return int(argv[1])
    if what == "system-exit":
        raise SystemExit(argv[1])
    if what == "raise":
        raise ValueError("the probe's bug")
    if what == "finalise":
        atexit.register(lambda: print("atexit ran", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished", flush=True))).start()
        return 0
    if what == "wait":  # write our pid, then wait: SIGTERM ends us with its default action unless handled
        if argv[2:3] == ["handle"]:
            signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(7)))
        with open(argv[1], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
        return 0
    raise SystemExit(f"unknown probe {what!r}")
