"""Fault-injection hooks for `megatron-rl drill` (issue #12): the one switch the failing component reads.

    MEGATRON_RL_DRILL='{"fault": "oom", "at_step": 2, "events": "/abs/run/drill_events.jsonl"}' \
        megatron-rl train --config configs/tiny_cpu_scratch.yaml

A drill is declared in the environment variable MEGATRON_RL_DRILL (a JSON object, or a list of them
to arm several faults in one run, each fault at most once: `megatron-rl drill together`) of the training
process; Ray actors and grader processes started by it inherit it.  Without the variable every
hook is a no-op costing one dict lookup.  The component that fails asks `drill_spec(fault)` and
injects the fault itself, so a drill exercises the real failure path, not a patched one:

    fault             read by                                what happens
    oom               LearnerWorker.train_step (every rank)  torch.OutOfMemoryError raised inside the
                                                             forward/backward of learner step at_step
                                                             (`times`: how many attempts fail, default 1;
                                                             2 makes the half-micro-batch retry fail too)
    learner_kill      LearnerWorker.train_step (rank `rank`) the rank SIGKILLs itself at learner step at_step
    verifier_timeout  reward.pool grader processes           a share `fraction` of grading calls hang
                                                             (chosen by a hash of response and reference;
                                                             `per: call`: each call drawn on its own)
    permute_load      publish.vllm_engine (engine processes) publication `at_version` is loaded with the
                                                             rows of its first matrix reversed, after its
                                                             bytes verified (`times` loads, default 1)
    engine_kill       RolloutWorker.generate (rollout actor) the vLLM engine-core process of the group that
                                                             generates round at_step is SIGKILLed while its
                                                             requests are in flight (once per run: the
                                                             restarted engine finds the event in `events`)
    engine_kill_publish RolloutWorker.receive_weights        the vLLM engine-core process of the first group
                      (rollout actor)                        to receive publication `at_version` is
                                                             SIGKILLed as it begins (once per run)
    engine_stop       RolloutWorker.receive_weights (rollout    the first group to receive publication
                      actor)                                 `at_version` SIGSTOPs its actor and vLLM
                                                             processes; a detached shell SIGCONTs them
                                                             `seconds` later (once per run)
    coordinator_stop  CoordinatorActor.put_many (coordinator) the first put of round at_step SIGSTOPs the
                                                             coordinator's process for `seconds` before it
                                                             is applied (once per run)
    stale_kv          StreamEngine refit (streaming actor)   from publication `at_version` on, a "recompute"
                                                             refit skips the KV invalidation and says it
                                                             happened: kept requests go on attending to the
                                                             old weights' KV (the stale-cache bug)
    engine_kill_refit StreamEngine refit (streaming actor)   the first in-flight refit to a version >=
                                                             `at_version` that keeps requests SIGKILLs the
                                                             vLLM engine-core process while generation is
                                                             paused, before the new weights load (once per run)

`at_step` counts learner steps from 0 (the step about to be learned: learner step s produces policy
version s+1).  Each injection appends {"fault", "at_step", "time", "pid"} to the JSON-lines file
`events` (if given), which the drill report reads to time detection and recovery.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import threading
import time
import zlib

logger = logging.getLogger(__name__)

ENV = "MEGATRON_RL_DRILL"
FAULTS = ("oom", "learner_kill", "verifier_timeout", "permute_load", "engine_kill", "engine_kill_publish",
          "engine_stop", "coordinator_stop", "stale_kv", "engine_kill_refit")


def drill_spec(fault: str) -> dict | None:
    """The armed spec that injects `fault`, else None.  A malformed variable is an error naming it (a
    drill that silently does not inject would report a false recovery)."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    try:
        specs = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{ENV} is not a JSON object or list: {err}") from err
    specs = specs if isinstance(specs, list) else [specs]
    if not specs or not all(isinstance(s, dict) and s.get("fault") in FAULTS for s in specs):
        raise ValueError(f"{ENV}: every spec's 'fault' must be one of {FAULTS}, got {raw!r}")
    names = [s["fault"] for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"{ENV}: a fault may be armed once per run, got {names}")
    return next((s for s in specs if s["fault"] == fault), None)


def record_injection(spec: dict, **extra) -> None:
    """Append one injection event to the spec's events file (best effort: a drill log never fails a run)."""
    logger.warning("drill: injecting %s (%s)", spec["fault"], extra or spec.get("at_step"))
    path = spec.get("events")
    if not path:
        return
    row = {"fault": spec["fault"], "at_step": spec.get("at_step"), "time": time.time(), "pid": os.getpid(), **extra}
    try:
        with open(path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    except OSError as err:
        logger.warning("drill: cannot write %s: %s", path, err)


def injected_before(spec: dict) -> bool:
    """Whether this run already injected the spec's fault (an event in its `events` file): a fault
    that kills a process must not fire again in the process that replaces it."""
    path = spec.get("events")
    if not path or not os.path.isfile(path):
        return False
    with open(path) as fh:
        return any(json.loads(line).get("fault") == spec["fault"] for line in fh if line.strip())


_CALLS = random.Random()  # `per: call` draws (a grader process's own stream)
VERIFIER_DRAWS = ("input", "call")
"""How verifier_timeout picks the calls that hang (its `per`; `hangs`)."""


def hangs(spec: dict, response: str, reference: str) -> bool:
    """Whether this grading call is one of the `fraction` that hang.  `per: input` (the default): chosen by a
    hash of response and reference, so the same input hangs every time (a verifier that chokes on some
    inputs; as a policy converges on one answer, the share of calls that hang follows it).  `per: call`: each
    call drawn on its own, so `fraction` of the calls hang whatever they grade."""
    share = float(spec.get("fraction", 0.1))
    per = spec.get("per", "input")
    if per == "call":
        return _CALLS.random() < share
    if per not in VERIFIER_DRAWS:
        raise ValueError(f"verifier_timeout: per must be 'input' or 'call', got {per!r}")
    h = zlib.crc32(f"{response}\x00{reference}".encode()) / 2**32
    return h < share


def maybe_kill_engine(llm, info: list | None) -> None:
    """Drill hook (`megatron-rl drill engine_crash`), called by RolloutWorker.generate with its prompts'
    PromptInfos: in the call of round at_step, SIGKILL this group's vLLM engine-core process once requests
    are in flight."""
    spec = drill_spec("engine_kill")
    if spec is None or not info or info[0].round != spec.get("at_step") or injected_before(spec):
        return
    threading.Thread(target=_kill_engine_core, args=(llm, spec), name="drill-engine-kill", daemon=True).start()


def maybe_kill_engine_in_publication(version: int) -> None:
    """Drill hook (`megatron-rl drill engine_crash_publish`), called by RolloutWorker.receive_weights: the
    first group to receive publication at_version SIGKILLs its vLLM engine-core process (once per run)."""
    spec = drill_spec("engine_kill_publish")
    if spec is None or version != int(spec["at_version"]) or injected_before(spec):
        return
    cores = _engine_cores()
    if cores:
        record_injection(spec, pid_killed=cores[0].pid, version=version)
        os.kill(cores[0].pid, signal.SIGKILL)
        time.sleep(1.0)  # the process is gone (and its workers with it) before the publication goes on


def maybe_kill_engine_in_refit(version: int, in_flight: int) -> None:
    """Drill hook (`megatron-rl drill refit_engine_death`), called by StreamEngine's refit while generation is
    paused with `in_flight` requests kept: the first such refit to a version >= at_version SIGKILLs this
    group's vLLM engine-core process before the new weights load (once per run)."""
    spec = drill_spec("engine_kill_refit")
    if spec is None or version < int(spec["at_version"]) or not in_flight or injected_before(spec):
        return
    cores = _engine_cores()
    if cores:
        record_injection(spec, pid_killed=cores[0].pid, version=version, in_flight_requests=in_flight)
        os.kill(cores[0].pid, signal.SIGKILL)
        time.sleep(1.0)  # the process is gone before the refit goes on


def _engine_cores() -> list:
    import psutil

    children = psutil.Process().children()
    cores = [p for p in children if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]
    if not cores:
        logger.error("drill engine_kill: no vLLM EngineCore process among %s", [p.name() for p in children])
    return cores


def _kill_engine_core(llm, spec: dict) -> None:
    cores = _engine_cores()
    if not cores:
        return
    deadline = time.monotonic() + 5.0
    in_flight = 0
    while time.monotonic() < deadline:  # mid-generation: requests were added and are not finished
        in_flight = llm.llm_engine.get_num_unfinished_requests()
        if in_flight:
            break
        time.sleep(0.0005)
    record_injection(spec, pid_killed=cores[0].pid, in_flight_requests=in_flight)
    os.kill(cores[0].pid, signal.SIGKILL)


def maybe_stop_group(version: int) -> None:
    """Drill hook (`megatron-rl drill partition`), called by RolloutWorker.receive_weights: the first
    rollout group to receive publication at_version stops answering -- its actor process and every
    process under it (vLLM's engine core and workers) get SIGSTOP -- and a detached shell sends
    SIGCONT `seconds` later.  One group per run: the first to create the claim file wins."""
    spec = drill_spec("engine_stop")
    if spec is None or version != spec.get("at_version") or not spec.get("events"):
        return
    try:
        os.close(os.open(spec["events"] + ".stop-claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # another group (or an earlier call) was stopped already
    _stop_this_process(spec, version=version)
    logger.warning("drill engine_stop: this rollout group answers again after %g s", float(spec.get("seconds", 20.0)))


def maybe_stop_coordinator(trajs: list) -> None:
    """Drill hook (`megatron-rl drill coordinator_stop`), called by CoordinatorActor.put_many: the first
    put of round at_step stops the coordinator's process (SIGSTOP) for `seconds`, with the put not yet
    applied; producers and the learner wait on it meanwhile.  Once per run (an event in `events`)."""
    spec = drill_spec("coordinator_stop")
    if spec is None or not trajs:
        return
    head = str(getattr(trajs[0], "id", "")).split("/", 1)[0]  # ids are "r<round>/<prompt>/<sample>"
    if head != f"r{int(spec.get('at_step', -1)):06d}" or injected_before(spec):
        return
    _stop_this_process(spec, trajectories=len(trajs))


def _stop_this_process(spec: dict, **extra) -> None:
    """SIGSTOP this process and every process under it; a detached shell sends SIGCONT `seconds` later
    (this call returns then)."""
    import psutil

    me = psutil.Process()
    below = me.children(recursive=True)
    pids = [me.pid] + [p.pid for p in below]
    seconds = float(spec.get("seconds", 20.0))
    record_injection(spec, pids_stopped=pids, seconds=seconds, **extra)
    subprocess.Popen(["sh", "-c", f"sleep {seconds:g}; kill -CONT {' '.join(map(str, reversed(pids)))}"],
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    for p in below:
        os.kill(p.pid, signal.SIGSTOP)
    os.kill(me.pid, signal.SIGSTOP)  # returns once the shell sent SIGCONT
