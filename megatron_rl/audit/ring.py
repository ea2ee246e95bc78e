"""A learner rank's host ring of recent policy versions' weights, for the in-training audit.

    ring = WeightRing(capacity=3)                 # AuditConfig.ring_versions(coordinator.max_version_lag)
    ring.keep(version, module)                    # at each publication: the weights published as `version`
    with ring.weights_of(version, module):        # the module computes with that version's weights
        logprobs_bt = learner.forward_logprobs(tokens_bt, lengths_b)
    ring.nbytes                                   # host memory held (megatron-rl plan counts it)

Each rank keeps its own shard (its tensor/pipeline part of every parameter) as CPU copies, the newest
`capacity` versions; a version kept again replaces its copy (a refit republishes the same weights).
`weights_of` copies the live parameters aside (one more copy, for the call's length), copies the
version's in, and puts the live ones back bit for bit, also when the forward raises: the weights the
optimizer steps on never change.  Buffers are not kept (training changes parameters only).
"""

from __future__ import annotations

import collections
import contextlib

import torch


class WeightRing:
    """The newest `capacity` versions' parameters of one rank's model, in host memory."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a weight ring needs capacity >= 1, got {capacity}")
        self.capacity = capacity
        self._ring: collections.OrderedDict[int, list[torch.Tensor]] = collections.OrderedDict()

    @property
    def versions(self) -> list[int]:
        return list(self._ring)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._ring.values() for t in ts)

    @torch.no_grad()
    def keep(self, version: int, module: torch.nn.Module) -> None:
        """Copy `module`'s parameters to host memory as `version`; the oldest version goes past capacity."""
        self._ring.pop(version, None)
        self._ring[version] = [p.detach().to("cpu", copy=True) for p in module.parameters()]
        while len(self._ring) > self.capacity:
            self._ring.popitem(last=False)

    @contextlib.contextmanager
    def weights_of(self, version: int, module: torch.nn.Module):
        """`module` holds `version`'s weights inside the block, its own again after it."""
        if version not in self._ring:
            raise KeyError(f"policy version {version} is not in the weight ring (it holds {self.versions})")
        params = list(module.parameters())
        kept = self._ring[version]
        if len(kept) != len(params):
            raise RuntimeError(f"version {version} was kept with {len(kept)} parameters, the model has {len(params)}")
        with torch.no_grad():
            live = [p.detach().to("cpu", copy=True) for p in params]
            try:
                for p, w in zip(params, kept):
                    p.copy_(w)
                yield
            finally:
                for p, w in zip(params, live):
                    p.copy_(w)
