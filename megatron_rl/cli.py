"""The `megatron-rl` console script: one entry point, one module per subcommand.

    megatron-rl --help
    megatron-rl make-tiny-model --arch llama --out /tmp/tiny

Each subcommand module exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int`.  Modules are imported only when listed here, so adding a command is one
line.  Heavy imports (torch, vLLM) happen inside the command functions, keeping `--help` fast.

The console is quiet (megatron_rl/console.py): progress and the project's own messages; library
and engine logs go to RUN_DIR/logs/.  `--verbose` (anywhere on the command line) shows them too.
Exit codes: 0 done; 2 input the user can fix (a `ConfigError`, e.g. a config key, a data file, a
checkpoint; or a missing file), with one `megatron-rl CMD: error: ...` line; a `CommandError`'s
own code; anything else is a bug: it propagates (its traceback, exit 1).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from typing import Callable

COMMAND_MODULES = [
    "megatron_rl.train.cli",
    "megatron_rl.eval_cli",
    "megatron_rl.experiment.cli",
    "megatron_rl.doctor_cli",
    "megatron_rl.report_cli",
    "megatron_rl.submit_cli",
    "megatron_rl.launch_cli",
    "megatron_rl.plan_cli",
    "megatron_rl.conversion.cli",
    "megatron_rl.checkpoint_cli",
    "megatron_rl.drill.cli",
    "megatron_rl.audit_cli",
    "megatron_rl.sandbox_cli",
    "megatron_rl.replay_cli",
    "megatron_rl.models.tiny_cli",
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
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="show library and engine logs (vLLM, Megatron, Ray) on the console too; "
                             "may also follow the subcommand")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _split_verbose(argv: list[str]) -> tuple[list[str], bool]:
    """`--verbose`/`-v` is accepted after the subcommand too (before a `--`)."""
    end = argv.index("--") if "--" in argv else len(argv)
    verbose = any(a in ("--verbose", "-v") for a in argv[:end])
    return [a for i, a in enumerate(argv) if i >= end or a not in ("--verbose", "-v")], verbose


def main(argv: list[str] | None = None) -> int:
    argv, verbose = _split_verbose(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    return run_command(args.command, lambda: args.func(args), verbose=verbose or args.verbose, level=args.log_level)


def run_command(name: str, func: Callable[[], int | None], *, verbose: bool = False, level: str = "INFO") -> int:
    """Run command `name`'s body `func` in a console session; returns its exit code (see the module's
    docstring).  main's, and the experiment runner's for a run inside its process (experiment/inprocess.py)."""
    from megatron_rl.config import ConfigError
    from megatron_rl.console import console_session

    with console_session(verbose=verbose, level=level) as console:
        try:
            return int(func() or 0)
        except CommandError as err:
            console.error_line(f"megatron-rl {name}: error: {err}")
            return err.exit_code
        except (ConfigError, FileNotFoundError, FileExistsError) as err:
            # What a user can fix: one clear line, no traceback.
            console.error_line(f"megatron-rl {name}: error: {err}")
            return 2
        except Exception:
            # A bug: it propagates (traceback on the console once the session is closed, exit 1);
            # the run's log file keeps a copy.
            console.to_file_only(f"megatron-rl {name}: internal error\n{traceback.format_exc()}")
            raise


if __name__ == "__main__":
    # `python -m megatron_rl.cli` runs this file as __main__: call the importable module's main, so the
    # CommandError commands raise (megatron_rl.cli.CommandError) is the class it catches (exit 75, ...).
    from megatron_rl import cli as _cli

    sys.exit(_cli.main())
