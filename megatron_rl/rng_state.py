"""A process's random number generators as JSON-safe data, saved per rank with each checkpoint.

    from megatron_rl.rng_state import capture_rng_state, restore_rng_state
    state = capture_rng_state()       # python random, numpy's global, torch CPU, CUDA (if present)
    restore_rng_state(state)          # e.g. load_rng_state(ckpt_dir, rank) from megatron_rl.checkpoint

Binary states (torch's ByteTensors) are base64 strings, so the checkpoint's rng/rank_N.json files
are plain JSON.
"""

from __future__ import annotations

import base64
import logging
import random
from typing import Any, Mapping

import numpy as np
import torch

from megatron_rl.checkpoint import CheckpointError

logger = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states: python `random`, numpy's global, torch CPU, and CUDA if present."""
    py_version, py_internal, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py_version, list(py_internal), py_gauss],
        "numpy": [np_name, [int(k) for k in np_keys], int(np_pos), int(np_has_gauss), float(np_cached)],
        "torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "cuda": None,
    }
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of capture_rng_state (CUDA states are restored only where CUDA is available)."""
    missing = [k for k in ("python", "numpy", "torch_cpu") if k not in state]
    if missing:
        raise CheckpointError(f"RNG state is missing {missing}")
    py_version, py_internal, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_internal), py_gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch_cpu"])), dtype=torch.uint8))
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            logger.warning("checkpoint holds CUDA RNG state but CUDA is not available here; not restored")
        else:
            tensors = [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in cuda]
            n = min(len(tensors), torch.cuda.device_count())
            for device in range(n):
                torch.cuda.set_rng_state(tensors[device], device)
