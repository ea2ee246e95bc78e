"""A quiet console: progress and the project's own messages on the terminal, the rest in RUN_DIR/logs/.

    with console_session(verbose=False) as console:     # megatron_rl.cli.main does this
        ...load the config...
        console.attach_run_dir(run_dir)                  # RUN_DIR/logs/driver.log from here on
        progress("step 3/60 | reward ...")               # a line per step, or a bar on a terminal

What reaches the console (stderr) by default:
  - progress lines (logger `megatron_rl.progress`): one bar redrawn in place when stderr is a
    terminal, else about ten lines per run (first, every ceil(steps/10)-th, last; all in the log);
  - records of the project's loggers (`megatron_rl.*`) at INFO and above;
  - errors (ERROR and above) from anything, including lines of Ray workers that look like errors.
Everything else -- vLLM, Megatron-Core, Ray, transformers, Python warnings, and whatever C/C++
code, child processes or progress bars of libraries write to stderr (file descriptor 2 and
`sys.stderr` point there once the run directory is known) -- goes to `RUN_DIR/logs/driver.log`;
the console handler keeps a duplicate of the original stderr.  The output of Ray
actors and tasks (the learner ranks, rollout workers and the vLLM engine processes they start,
the coordinator) goes to `RUN_DIR/logs/ray_<ActorClass>.log`, one line per line they wrote,
prefixed with the process id.  Records logged before the run directory is known are kept and
written once it is.  `--verbose` shows everything on the console as before (files still written).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import threading
from pathlib import Path

PROGRESS_LOGGER = "megatron_rl.progress"
DRIVER_LOG = "driver.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
WORKER_FORMAT = "%(levelname)s %(name)s: %(message)s"
_PROJECT_WARNING = re.compile(r"^(WARNING|ERROR|CRITICAL) (megatron_rl\.[\w.]+): (.*)$")
_ERROR_LINE = re.compile(r"(^|\s|\[)(ERROR|CRITICAL|FATAL)\b|^Traceback \(most recent call last\)")

progress_log = logging.getLogger(PROGRESS_LOGGER)


PIPED_PROGRESS_LINES = 10
"""Where stderr is not a terminal, a run of `total` steps shows about this many progress lines (the
first, every ceil(total / 10)-th and the last); RUN_DIR/logs/driver.log keeps every one."""


def progress(line: str, step: int | None = None, total: int | None = None) -> None:
    """One progress line (step, version, reward, ...): the terminal's bar, or a console line (for
    step `step` of `total`, only some of them: PIPED_PROGRESS_LINES)."""
    progress_log.info("%s", line, extra={"progress_step": step, "progress_total": total})


def progress_due(step: int | None, total: int | None, lines: int = PIPED_PROGRESS_LINES) -> bool:
    """Whether a piped console shows the progress line of `step` of `total`."""
    if step is None or not total:
        return True
    stride = -(-total // lines)
    return step in (1, total) or step % stride == 0


class ConsoleHandler(logging.Handler):
    """Writes to the console stream; progress records become a bar on a terminal.

    On a terminal the bar is the last line, redrawn in place ("\\r"); any other record clears it,
    is printed, and the bar is drawn again below it.  Elsewhere (a pipe, a file) every progress
    record is its own line.
    """

    def __init__(self, stream, *, verbose: bool, bar: bool | None = None) -> None:
        super().__init__(logging.DEBUG)
        self.stream = stream
        self.verbose = verbose
        self.bar = _isatty(stream) if bar is None else bar
        self._bar_text = ""
        self.setFormatter(logging.Formatter(FORMAT, "%H:%M:%S"))

    def shown(self, record: logging.LogRecord) -> bool:
        if self.verbose or record.levelno >= logging.ERROR:
            return True
        return record.name.startswith("megatron_rl") and record.levelno >= logging.INFO

    def emit(self, record: logging.LogRecord) -> None:
        if not self.shown(record):
            return
        try:
            if record.name == PROGRESS_LOGGER:
                if self.bar or progress_due(getattr(record, "progress_step", None),
                                            getattr(record, "progress_total", None)):
                    self._progress(record.getMessage())
            else:
                self._line(self.format(record))
            self.stream.flush()
        except Exception:  # a console that went away must not stop the run
            self.handleError(record)

    def _progress(self, text: str) -> None:
        if not self.bar:
            self.stream.write(text + "\n")
            return
        self._bar_text = text
        self.stream.write("\r\x1b[K" + text)

    def _line(self, text: str) -> None:
        if self._bar_text:
            self.stream.write("\r\x1b[K" + text + "\n" + self._bar_text)
        else:
            self.stream.write(text + "\n")

    def end_bar(self) -> None:
        """Leave the last bar on screen as a finished line."""
        if self._bar_text:
            self.stream.write("\n")
            self.stream.flush()
            self._bar_text = ""


class BufferHandler(logging.Handler):
    """Keeps records until the run directory (and its log file) is known."""

    def __init__(self, capacity: int = 10000) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.capacity = capacity

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < self.capacity:
            self.records.append(record)


class ConsoleSession:
    """Logging set-up of one CLI invocation; undone by `close` (tests call main() in-process)."""

    def __init__(self, *, verbose: bool, level: str = "INFO", bar: bool | None = None) -> None:
        self.verbose = verbose
        self.level = getattr(logging, level.upper(), None)
        if not isinstance(self.level, int):
            raise ValueError(f"--log-level {level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)")
        self.log_dir: Path | None = None
        self.console_stream = sys.stderr
        self.console = ConsoleHandler(self.console_stream, verbose=verbose, bar=bar)
        self.console.setLevel(self.level)
        self.buffer = BufferHandler()
        self.file_handler: logging.Handler | None = None
        self._saved_fd2: int | None = None
        self._saved_stderr = self.console_stream
        self._worker_files: dict[str, io.TextIOBase] = {}
        self._worker_lock = threading.Lock()
        self._root_state = _root_state()
        root = logging.getLogger()
        root.handlers = [self.console, self.buffer]
        root.setLevel(min(self.level, logging.INFO))
        logging.captureWarnings(True)
        self._ray_hook_installed = False

    # ---- the run directory ------------------------------------------------------------------

    def attach_run_dir(self, run_dir: str | Path, log_name: str = DRIVER_LOG) -> Path:
        """From now on write RUN_DIR/logs/LOG_NAME (with what was logged so far) and, unless
        verbose, send file descriptor 2 (C/C++ libraries, child processes) there too."""
        log_dir = Path(run_dir).resolve() / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        if self.log_dir == log_dir:
            return log_dir
        self._detach_file()
        self.log_dir = log_dir
        handler = logging.FileHandler(log_dir / log_name, encoding="utf-8")
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.setLevel(logging.DEBUG)
        for record in self.buffer.records:
            handler.handle(record)
        self.buffer.records.clear()
        root = logging.getLogger()
        root.removeHandler(self.buffer)
        root.addHandler(handler)
        self.file_handler = handler
        if not self.verbose:
            self._redirect_fd2(log_dir / log_name)
            if not self._ray_hook_installed:  # Ray is imported only by commands that run something
                self._ray_hook_installed = _install_ray_hook(self)
        return log_dir

    def _redirect_fd2(self, path: Path) -> None:
        try:
            fd2 = sys.__stderr__.fileno() if sys.__stderr__ is not None else 2
        except (AttributeError, ValueError, io.UnsupportedOperation):
            return
        sys.__stderr__.flush()
        if self._saved_fd2 is None:
            self._saved_fd2 = os.dup(fd2)
            console = os.fdopen(os.dup(self._saved_fd2), "w", buffering=1, encoding="utf-8", errors="replace")
            if self.console_stream is sys.__stderr__:  # not replaced by a test harness
                self.console.stream = self.console_stream = console
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(target, fd2)
        os.close(target)

    def _detach_file(self) -> None:
        if self.file_handler is not None:
            logging.getLogger().removeHandler(self.file_handler)
            self.file_handler.close()
            self.file_handler = None

    def error_line(self, text: str) -> None:
        """A line for the console whatever fd 2 points at (and for the log file)."""
        self.console.end_bar()
        self.console_stream.write(text + "\n")
        self.console_stream.flush()
        self.to_file_only(text)

    def to_file_only(self, text: str) -> None:
        if self.file_handler is not None:
            self.file_handler.stream.write(text + "\n")
            self.file_handler.flush()

    # ---- Ray workers' output -----------------------------------------------------------------

    def worker_output(self, data: dict) -> None:
        """Ray's per-batch callback for what its workers wrote: lines to RUN_DIR/logs/ray_<name>.log,
        error-looking lines also to the console."""
        pid = data.get("pid")
        name = data.get("actor_name") or data.get("task_name") or (pid if isinstance(pid, str) else "worker")
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", str(name))[:80]
        prefix = f"(pid={pid}{', ' + str(data['ip']) if data.get('ip') else ''}) "
        lines = [str(line) for line in data.get("lines", [])]
        if not lines:
            return
        name = name or "worker"
        errors = [line for line in lines if _ERROR_LINE.search(line) and not _PROJECT_WARNING.match(line)]
        with self._worker_lock:
            fh = self._worker_file(name)
            if fh is not None:
                fh.write("".join(prefix + line + "\n" for line in lines))
                fh.flush()
        workers = logging.getLogger("ray.workers")
        for line in errors:
            workers.error("%s%s%s", name, prefix, line)
        for line in lines:  # the project's own warnings in an actor (configure_worker_logging)
            m = _PROJECT_WARNING.match(line)
            if m:
                logging.getLogger(m.group(2)).log(logging.getLevelName(m.group(1)), "(%s %s) %s", name,
                                                  prefix.strip(), m.group(3))
        if self.log_dir is None:  # nowhere else to put them yet: the driver log keeps them
            for line in lines:
                if line not in errors:
                    workers.info("%s%s%s", name, prefix, line)

    def _worker_file(self, name: str):
        if self.log_dir is None:
            return None
        fh = self._worker_files.get(name)
        if fh is None:
            fh = self._worker_files[name] = (self.log_dir / f"ray_{name}.log").open("a", encoding="utf-8")
        return fh

    # ---- the end -----------------------------------------------------------------------------

    def close(self) -> None:
        self.console.end_bar()
        if self._ray_hook_installed:
            _remove_ray_hook(self)
        with self._worker_lock:
            for fh in self._worker_files.values():
                fh.close()
            self._worker_files.clear()
        self._detach_file()
        if self._saved_fd2 is not None:
            sys.__stderr__.flush()
            os.dup2(self._saved_fd2, sys.__stderr__.fileno())
            os.close(self._saved_fd2)
            self._saved_fd2 = None
            if self.console_stream is not self._saved_stderr:
                self.console_stream.close()
                self.console.stream = self.console_stream = self._saved_stderr
        logging.captureWarnings(False)
        _restore_root(self._root_state)


_current: ConsoleSession | None = None


def configure_worker_logging(level: int = logging.INFO) -> None:
    """In a Ray actor: the project's records as `LEVEL name: message` lines on stderr, which the
    driver's session files under RUN_DIR/logs/ray_<Actor>.log and whose warnings and errors it
    shows on the console.  Once per process; other loggers are left as they are."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return  # not a Ray actor (e.g. a RolloutWorker used in-process): the caller's logging stands
    project = logging.getLogger("megatron_rl")
    if any(getattr(h, "megatron_rl_worker", False) for h in project.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(WORKER_FORMAT))
    handler.megatron_rl_worker = True
    project.addHandler(handler)
    project.setLevel(level)
    project.propagate = False


def current() -> ConsoleSession | None:
    """The session of this CLI invocation (None when the library is used without the CLI)."""
    return _current


def end_progress() -> None:
    """Finish the terminal's bar (a newline) before the command prints its result on stdout."""
    if _current is not None:
        _current.console.end_bar()


def attach_run_dir(run_dir: str | Path, log_name: str = DRIVER_LOG) -> Path | None:
    """`ConsoleSession.attach_run_dir` of the current session; nothing without one."""
    return _current.attach_run_dir(run_dir, log_name) if _current is not None else None


@contextlib.contextmanager
def console_session(*, verbose: bool, level: str = "INFO", bar: bool | None = None):
    global _current
    session = ConsoleSession(verbose=verbose, level=level, bar=bar)
    previous, _current = _current, session
    try:
        yield session
    finally:
        _current = previous
        session.close()


# ---- helpers --------------------------------------------------------------------------------


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _root_state():
    root = logging.getLogger()
    return list(root.handlers), root.level


def _restore_root(state) -> None:
    root = logging.getLogger()
    root.handlers, level = list(state[0]), state[1]
    root.setLevel(level)


def _install_ray_hook(session: ConsoleSession) -> bool:
    """After every ray.init of this process (and now, when Ray is up already): Ray's logger propagates
    to ours, and the output of Ray workers comes to `session.worker_output` instead of being printed."""
    try:
        from ray._private import worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher
    except ImportError:
        return False

    def own_ray_logger() -> None:  # Ray's own handler prints to the console; ours decide
        ray_logger = logging.getLogger("ray")
        ray_logger.handlers.clear()
        ray_logger.propagate = True

    def hook() -> None:
        own_ray_logger()
        global_worker_stdstream_dispatcher.remove_handler("ray_print_logs")
        global_worker_stdstream_dispatcher.remove_handler("megatron_rl_worker_logs")
        global_worker_stdstream_dispatcher.add_handler("megatron_rl_worker_logs", session.worker_output)

    own_ray_logger()
    hook.megatron_rl_session = session
    ray_worker._post_init_hooks.append(hook)
    if ray_worker.global_worker.connected:  # Ray is up already (a run inside the experiment runner)
        hook()
    return True


def _remove_ray_hook(session: ConsoleSession) -> None:
    from ray._private import worker as ray_worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher

    ray_worker._post_init_hooks[:] = [h for h in ray_worker._post_init_hooks
                                      if getattr(h, "megatron_rl_session", None) is not session]
    global_worker_stdstream_dispatcher.remove_handler("megatron_rl_worker_logs")
