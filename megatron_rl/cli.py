"""The `megatron-rl` console script: one entry point, one module per subcommand.

    megatron-rl --help
    megatron-rl make-tiny-model --arch llama --out /tmp/tiny

Each subcommand module exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int`.  Modules are imported only when listed here, so adding a command is one
line.  Heavy imports (torch, vLLM) happen inside the command functions, keeping `--help` fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMAND_MODULES = [
    "megatron_rl.train.cli",
    "megatron_rl.eval_cli",
    "megatron_rl.experiment_cli",
    "megatron_rl.doctor_cli",
    "megatron_rl.submit_cli",
    "megatron_rl.planner.cli",
    "megatron_rl.conversion.cli",
    "megatron_rl.checkpoint_cli",
    "megatron_rl.drill_cli",
    "megatron_rl.models.tiny",
]


class CommandError(Exception):
    """Ends a command with one `megatron-rl CMD: error: ...` line and `exit_code` (not "bad input").

    For failures that are neither bad input (exit 2) nor bugs (a traceback), e.g. a run that
    stopped because a rollout engine died and can be resumed by rerunning (exit 75).
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except CommandError as err:
        print(f"megatron-rl {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        # What a user can fix: one clear line, no traceback.
        print(f"megatron-rl {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # `python -m megatron_rl.cli` runs this file as __main__: call the importable module's main, so the
    # CommandError commands raise (megatron_rl.cli.CommandError) is the class it catches (exit 75, ...).
    from megatron_rl import cli as _cli

    sys.exit(_cli.main())
