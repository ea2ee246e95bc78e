"""vLLM weight-transfer backend "megatron_rl_nccl": vLLM's NCCL transfer, checked before commit.

GPU path.  The bytes travel as vLLM's own NCCL backend sends them (its communicator and its
packed, double-buffered broadcast; nothing of that is rewritten here).  What vLLM's engine
does not do is wait: it loads each chunk into the model as it arrives, so a publication
that fails half way leaves a model half old, half new.  This engine keeps vLLM's receive
and changes what happens to the tensors:

    learner rank 0 (transports.py NcclTransport)       each vLLM worker (this engine)
    ----------------------------------------------     ----------------------------------
    RPC receive_weights(version, names/shapes/dtypes)  start: nothing touches the model
    ManifestRecorder hashes each bucket on the GPU  -> packed NCCL broadcast -> tensors kept
    as it passes to vLLM's packed producer             (views of the received chunks)
    RPC commit_weights(manifest)                       verify: names, order, shapes, dtypes
                                                       and every bucket digest (on the GPU)
                                                       finish: load all, or drop all

so the all-or-nothing rule and the report (bucket index and tensor names) are the same as on the
gloo path (VerifiedCommit).  The sender is learner rank 0's transport (publish/transports.py
`NcclTransport.send`, called by its WeightPublisher.publish, publish/trainer.py, in
LearnerWorker.publish); the other learner ranks only drive their share of the gathers.  The received
chunks stay alive until finish: every worker -- each TP rank -- holds the whole unsharded model once
more in GPU memory during a publication, outside vLLM's gpu_memory_utilization budget; leave room
for it.

vLLM's init_transfer_engine assigns a new communicator over the old one without destroying it,
and a communicator is not freed when dropped (its NCCL state lives outside Python): a regroup,
a restarted trainer or a pooled run would leak one per init.  So the last one is destroyed first,
and at shutdown (transports.destroy_communicator).

Not run in CI (no GPU there); tests/gpu/test_gpu_publish_nccl.py checks it on two GPUs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

from megatron_rl.publish.transports import destroy_communicator
from megatron_rl.publish.vllm_engine import VerifiedCommit, engine_rank

log = logging.getLogger(__name__)


@dataclass
class CheckedNCCLUpdateInfo(NCCLWeightTransferUpdateInfo):
    """vLLM's per-round metadata (names, dtype names, shapes) plus the version announced."""

    version: int = -1


class CheckedNCCLWeightTransferEngine(VerifiedCommit, NCCLWeightTransferEngine):
    """vLLM's NCCL receive into kept tensors; the model changes only after verify() passed."""

    update_info_cls = CheckedNCCLUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._init_commit()
        self.received: tuple[int, list[tuple[str, torch.Tensor]]] | None = None

    def init_transfer_engine(self, init_info) -> None:
        self._destroy_group()  # a group joined before: vLLM's init would drop it undestroyed
        super().init_transfer_engine(init_info)
        self.rank = engine_rank(init_info.rank_offset, self.parallel_config)

    def start_weight_update(self) -> None:
        # vLLM's engine starts a layerwise reload of the live model here; we do that only at finish.
        self.staged, self.received = None, None

    def receive_weights(self, update_info: CheckedNCCLUpdateInfo) -> None:
        if self.model_update_group is None:
            raise RuntimeError("NCCL weight transfer used before init_weight_transfer_engine")
        expected = ((name, (shape, getattr(torch, dtype)))
                    for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes))
        kept: list[tuple[str, torch.Tensor]] = []
        if self.packed:
            # Each chunk is a fresh buffer; keeping views of it keeps it (nothing is copied).
            packed_nccl_broadcast_consumer(iterator=expected, group=self.model_update_group, src=0,
                                           post_unpack_func=kept.extend,
                                           buffer_size_bytes=self.packed_buffer_size_bytes,
                                           num_buffers=self.packed_num_buffers, device=self.device)
        else:
            for name, (shape, dtype) in expected:
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
                self.model_update_group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
                kept.append((name, tensor))
        torch.cuda.current_stream().synchronize()
        self.received = (update_info.version, kept)
        self.status = {"version": update_info.version, "ok": None, "error": "received; waiting for the manifest",
                       "bad_bucket": None, "rank": self.rank, "tensors": len(kept)}

    def finish_weight_update(self) -> None:
        self.received = None  # never verified: nothing of it may stay alive
        super().finish_weight_update()

    def shutdown(self) -> None:
        self.staged, self.received = None, None
        self._destroy_group()  # vLLM 0.32's shutdown does it too; this does not rely on that
        super().shutdown()

    def _destroy_group(self) -> None:
        comm, self.model_update_group = self.model_update_group, None
        destroy_communicator(comm)
