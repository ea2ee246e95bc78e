"""Which publication transport a run uses, chosen once at start-up from (placement, device), and
the one object per path that carries it (publish/transports.py); the only module that tells the
paths apart by name.

    from megatron_rl.publish.transport import choose_transport, placement_problem, make_transport
    choose_transport("colocated", "cuda")            # -> "ipc"
    choose_transport("disaggregated", "cuda")        # -> "nccl"
    choose_transport("colocated", "cpu")             # -> "gloo"
    choose_transport("colocated", "cuda", "gloo")    # -> "gloo" (an override that fits)
    choose_transport("colocated", "cuda", "nccl")    # ConfigError naming rollout.weight_transfer

The rule, and why:
  cpu                   gloo: the only transport without CUDA (our wire protocol over TCP).
  cuda + colocated      ipc: the engine reads the learner's tensors in place through CUDA IPC
                        handles (same GPU, no copy through host memory, no second NCCL rank on
                        one device, which NCCL refuses); on several GPUs a learner rank on each
                        engine GPU holds a copy for the engines there (ipc_route.py).
  cuda + disaggregated  nccl: the engines sit on other GPUs; vLLM's packed NCCL broadcast.
Every one of them is checked before commit (vllm_engine.VerifiedCommit): a rollout group
switches only when the whole publication arrived intact.

`rollout.weight_transfer` is "auto" by default.  A user may name a transport instead; "gloo"
fits every placement and device (slower on GPUs: through host memory).  A transport that
contradicts the placement or the device is a ConfigError naming the field: the placement part
is checked with the rest of the config (placement_problem, before anything starts), the device
part once the device is known (choose_transport, at start-up).  "none" (generation only) is
passed through; training refuses it in its own config check.

    transport_class("ipc").device                    # -> "cuda": what other layers ask of a path
    make_transport("gloo", host=ip, bucket_bytes=b, checksum_algo="blocksum", timeout_s=600)
"""

from __future__ import annotations

import logging

from megatron_rl.config import ConfigError

log = logging.getLogger(__name__)

FIELD = "rollout.weight_transfer"
AUTO = "auto"
PLACEMENTS = ("colocated", "disaggregated")
DEVICES = ("cpu", "cuda")
NEEDS_CUDA = ("ipc", "nccl")
# transport -> the placement it cannot serve, and why
WRONG_PLACEMENT = {
    "nccl": ("colocated", "with colocated roles the trainer and a rollout engine share a GPU, and NCCL refuses "
                          "two ranks on one device"),
    "ipc": ("disaggregated", "CUDA IPC opens memory of the GPU the engine runs on, so the trainer must share it; "
                             "disaggregated engines have GPUs of their own"),
}


def placement_problem(transport: str, placement: str) -> str | None:
    """Why `transport` cannot serve `placement` (a message naming the field), or None."""
    wrong = WRONG_PLACEMENT.get(transport)
    if wrong is None or wrong[0] != placement:
        return None
    fits = "ipc" if placement == "colocated" else "nccl"
    needs = "disaggregated" if transport == "nccl" else "colocated"
    return (f"{FIELD} {transport!r} needs run.placement {needs!r}: {wrong[1]} "
            f"(use '{AUTO}', which picks {fits!r} on GPUs, or 'gloo')")


def choose_transport(placement: str, device: str, requested: str = AUTO) -> str:
    """The transport for this run: `requested` when it fits (placement, device), the rule above
    for "auto"; raises ConfigError naming rollout.weight_transfer when it does not fit."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"run.placement {placement!r} is not one of {list(PLACEMENTS)}")
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {list(DEVICES)}")
    if requested == AUTO:
        chosen = "gloo" if device == "cpu" else ("ipc" if placement == "colocated" else "nccl")
        log.debug("publication transport: %s (%s placement on %s)", chosen, placement, device)
        return chosen
    problem = placement_problem(requested, placement)
    if problem is not None:
        raise ConfigError(problem)
    if requested in NEEDS_CUDA and device != "cuda":
        raise ConfigError(f"{FIELD} {requested!r} needs CUDA, but this run has no GPU (use '{AUTO}' or 'gloo')")
    if requested == "gloo" and device == "cuda":
        log.info("publication transport: gloo as asked (through host memory; '%s' would pick %s)", AUTO,
                 "ipc" if placement == "colocated" else "nccl")
    return requested


TRANSPORTS = ("gloo", "nccl", "ipc")


def transport_class(name: str):
    """The path named `name` (publish/transports.py); a standalone engine, outside a run's start-up,
    takes "auto" as "gloo".  Imported here, not at the top: the config check needs no torch."""
    from megatron_rl.publish import transports

    classes = {c.name: c for c in (transports.GlooTransport, transports.NcclTransport, transports.IpcTransport)}
    assert tuple(classes) == TRANSPORTS
    if name == AUTO:
        return classes["gloo"]
    if name not in classes:
        raise ValueError(f"publication transport {name!r} is not one of {list(TRANSPORTS)}")
    return classes[name]


def make_transport(name: str, **kw):
    """The transport object for `name` (choose_transport's answer), with its settings."""
    return transport_class(name)(**kw)


def whole_model_per_gpu(placement: str, requested: str) -> bool:
    """Whether a GPU run with this placement and rollout.weight_transfer holds a whole copy of the
    model on each GPU it publishes to (the planner asks; an impossible pairing answers False)."""
    try:
        return transport_class(choose_transport(placement, "cuda", requested)).whole_model_per_gpu
    except (ConfigError, ValueError):
        return False
