"""vLLM weight-transfer backend "megatron_rl_ipc": CUDA IPC from the learner's GPU, checked before commit.

GPU path, colocated placement (publish/transport.py picks it for colocated runs on GPUs).  The
learner rank and the rollout engine share one GPU, so the engine can read the learner's tensors
in place: the trainer exports a CUDA IPC handle per tensor (torch's reduce_tensor, as vLLM's own
`ipc` engine does, unpacked), and the engine opens them (rebuild_cuda_tensor).  Nothing goes
through host memory and there is no second NCCL rank on the device.  vLLM's engine loads each
tensor into the model as it opens it; this one keeps them and changes what happens next:

    learner rank 0 (transports.py IpcTransport)         each vLLM worker (this engine)
    ---------------------------------------------       ------------------------------------
    ManifestRecorder hashes each bucket on the GPU       RPC receive_weights(version, names/
    export_ipc_handles: a copy in the staging buffer ->  dtypes/shapes, pickled handles): opens
    (ipc_staging.py), one handle per tensor              every handle; nothing touches the model
    RPC commit_weights(manifest)                     ->  verify: names, order, shapes, dtypes and
                                                         every bucket digest, read through the
                                                         handles; finish: load all or drop all
    every group answered: the staging may be written again

The sender is learner rank 0's transport (publish/transports.py `IpcTransport.send`, called by its
WeightPublisher.publish, publish/trainer.py, in LearnerWorker.publish).  The digests are computed by
the trainer before export and recomputed by the engine over the memory it will load from, so a
publication the engine switches to is byte for byte the one the trainer hashed.  The trainer holds
every exported tensor (one copy of the model in the engine's dtype, on the learner's GPU, in a
staging buffer kept across steps and never the learner's own parameters: publish/ipc_staging.py)
until every group answered; the engine holds only views.  vLLM's packed IPC mode is refused: it
reuses one buffer per chunk, so nothing could be held for verification without a second copy on the
engine side.

Several GPUs (a colocated node): the handles are keyed by GPU UUID.  A learner rank on each
other engine GPU holds a byte-for-byte copy of the publication and exports its own handles, the
publisher sends the union ({UUID: handle} per tensor), and each engine worker opens its own
GPU's handle and verifies the same digests over that copy (publish/ipc_route.py: the route,
planned at connect, refuses an engine GPU with no learner rank, naming it).

Not run in CI (no GPU there).  The verify/commit logic is tested on CPU with the CUDA handle step
replaced (tests/unit/test_publish_ipc.py, and across gloo ranks tests/dist/test_ipc_route.py);
tests/gpu/test_gpu_colocated_ipc.py runs it on a GPU, tests/gpu/test_gpu_colocated_ipc_multi.py on two.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCWeightTransferEngine,
    IPCWeightTransferInitInfo,
    IPCWeightTransferUpdateInfo,
)

from megatron_rl.publish.ipc_route import (  # noqa: F401 -- the trainer's half, re-exported
    Handle,
    export_cuda_handle,
    export_ipc_handles,
    gpu_uuid,
    pickle_handles,
)
from megatron_rl.publish.ipc_staging import open_cuda_handle
from megatron_rl.publish.manifest import dtype_name
from megatron_rl.publish.vllm_engine import VerifiedCommit, engine_rank
from megatron_rl.publish.wire import ReceivedPublication

log = logging.getLogger(__name__)


@dataclass
class CheckedIPCInitInfo(IPCWeightTransferInitInfo):
    """vLLM's IPC init info (`packed`, which must be False here) plus this group's first rank."""

    rank_offset: int = 0


@dataclass
class CheckedIPCUpdateInfo(IPCWeightTransferUpdateInfo):
    """vLLM's per-round metadata and handles plus the version announced."""

    version: int = -1


class CheckedIPCWeightTransferEngine(VerifiedCommit, IPCWeightTransferEngine):
    """vLLM's IPC receive into kept views; the model changes only after verify() passed."""

    init_info_cls = CheckedIPCInitInfo
    update_info_cls = CheckedIPCUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._init_commit()
        self._init_ipc()

    def _init_ipc(self, opener: Callable[[Handle, torch.device], torch.Tensor] = open_cuda_handle) -> None:
        self.received: tuple[int, list[tuple[str, torch.Tensor]]] | None = None
        self.open_error: str | None = None
        self.open_handle = opener  # the CUDA step (a CPU test replaces it)

    def init_transfer_engine(self, init_info: CheckedIPCInitInfo) -> None:
        if init_info.packed:
            raise ValueError("megatron_rl_ipc refuses packed IPC: one reused buffer cannot be held for verification")
        super().init_transfer_engine(init_info)
        self.rank = engine_rank(init_info.rank_offset, self.parallel_config)

    def start_weight_update(self) -> None:
        # vLLM's engine starts a layerwise reload of the live model here; we do that only at finish.
        self.staged, self.received, self.open_error = None, None, None

    def receive_weights(self, update_info: CheckedIPCUpdateInfo) -> None:
        """Open every handle and check it holds what was announced; keep the views (no copy)."""
        kept: list[tuple[str, torch.Tensor]] = []
        self.open_error = None
        for name, dtype, shape, handle in zip(update_info.names, update_info.dtype_names, update_info.shapes,
                                              update_info.ipc_handles):
            try:
                tensor = self.open_handle(handle, self.device)
            except Exception as err:  # noqa: BLE001 -- reported at verify; the engine stays up
                self.open_error = f"rank {self.rank}: could not open the IPC handle of {name}: {err}"
                break
            if dtype_name(tensor.dtype) != dtype or list(tensor.shape) != list(shape):
                self.open_error = (f"rank {self.rank}: the IPC handle of {name} holds {dtype_name(tensor.dtype)} "
                                   f"{list(tensor.shape)}, announced {dtype} {list(shape)}")
                break
            kept.append((name, tensor))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the trainer's writes are visible before anything reads them
        self.received = (update_info.version, kept)
        self.status = {"version": update_info.version, "ok": None, "error": "received; waiting for the manifest",
                       "bad_bucket": None, "rank": self.rank, "tensors": len(kept)}

    def verify(self, manifest: dict[str, Any]) -> None:
        if self.open_error is not None and self.received is not None:
            version, self.received = self.received[0], None
            self._stage(ReceivedPublication(None, error=self.open_error), version)
            return
        super().verify(manifest)

    def finish_weight_update(self) -> None:
        self.received = None  # never verified: no view of the trainer's memory may stay
        super().finish_weight_update()

    def shutdown(self) -> None:
        self.staged, self.received = None, None
        super().shutdown()
