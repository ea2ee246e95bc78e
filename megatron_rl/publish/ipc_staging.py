"""The reusable staging buffer a CUDA IPC publication is copied into and exported from.

    staging = IpcStaging()                          # one per learner rank on the route, kept across steps
    meta, handles, views = staging.export(pairs)    # the publisher: copy each tensor in, one handle each
    views = staging.place(meta); handles = staging.handles(views)   # a holder: room for a broadcast copy
    staging.release()                               # at close: the blocks and their exports go

Why a copy, and why one kept buffer (issue 31, item 10).  At TP1 with bf16 parameters a tensor the
learner publishes is a view of its DDP parameter buffer.  torch's CUDA IPC export (`reduce_tensor` ->
`_share_cuda_`) wraps the storage's memory in a new ref-counted context, with a CUDA event of its
own, every time it is called, and nothing unwraps it while the storage lives: exporting the live
parameters every step piles these contexts up on memory that never dies, and once 1000 events are
outstanding every further export synchronises the device.  An engine reading the learner's own
memory would also see the next optimizer step's writes.

So every publication is copied into blocks allocated once and kept: the same model lands at the
same offsets every time, each block is exported once (`CudaBlockExports`: torch wraps it once), and a
tensor's handle is its block's handle with the tensor's own size, stride, offset and dtype.  The
engine opens it as any reduce_tensor handle (`open_cuda_handle` below).  The ref
counter torch attaches to an export means nothing for a block that lives as long as the transport:
the protocol keeps it alive instead (ipc_route.py `ipc_round`: every engine answers, and drops its
views at finish_weight_update, before the next publication writes the block again).

Memory: one copy of the model in the engine's dtype on each learner rank of the IPC route, resident
from the first publication to the transport's close (planner/ledger.py counts it as `publish`).

Layout of a view: blocks are uint8, at least `block_bytes`; tensors are placed in order, each at a
256-byte aligned offset, moving to the next block when the current one has no room.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from math import prod

import torch

from megatron_rl.publish.manifest import dtype_name, to_dtype

ALIGN = 256  # bytes: every staged tensor starts on a 256-byte boundary (any dtype's element size divides it)
BLOCK_BYTES = 256 << 20
Handle = dict[str, tuple]  # GPU UUID -> torch.multiprocessing.reductions.reduce_tensor args


def gpu_uuid(device_index: int | None = None) -> str:
    """UUID of a CUDA device (the current one by default): IPC handles are keyed by it."""
    index = torch.cuda.current_device() if device_index is None else device_index
    return str(torch.cuda.get_device_properties(index).uuid)


def export_cuda_handle(tensor: torch.Tensor) -> Handle:
    """torch's own CUDA IPC export of `tensor` (wraps its storage again at each call: see above)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    return {gpu_uuid(tensor.device.index): args}


def open_cuda_handle(handle: Handle, device: torch.device) -> torch.Tensor:
    """The CUDA step on the engine side: the tensor a handle points at, on this engine's GPU (vllm_ipc.py
    uses it, and so does tests/gpu/stage1.py, which opens a publication without vLLM)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid = gpu_uuid(device.index)
    if uuid not in handle:
        raise ValueError(f"no IPC handle for this engine's GPU {uuid} (handles are for {sorted(handle)}): no learner "
                         "rank on this GPU holds a copy of the publication (publish/ipc_route.py)")
    args = list(handle[uuid])
    args[6] = device.index  # reduce_tensor's storage device, as numbered in this process
    return rebuild_cuda_tensor(*args)


def retarget(block_args: tuple, view: torch.Tensor) -> tuple:
    """reduce_tensor's args for `block_args`' whole block, made to describe `view`, a view of that
    block (rebuild_cuda_tensor builds it from the block's storage at the view's offset)."""
    args = list(block_args)
    args[0] = torch.Tensor  # tensor class
    args[1], args[2], args[3] = view.size(), view.stride(), view.storage_offset()  # in elements of its dtype
    args[5] = view.dtype
    args[10] = False  # requires_grad
    return tuple(args)


class CudaBlockExports:
    """The CUDA step for views of IpcStaging blocks: each block's storage is exported once, and a
    view's handle is that export retargeted to the view.  Only for blocks that outlive this object's
    use (a freed block's pointer could be handed to another storage): IpcStaging clears it on release."""

    def __init__(self, export_block: Callable[[torch.Tensor], Handle] = export_cuda_handle) -> None:
        self.export_block = export_block
        self.blocks: dict[int, Handle] = {}  # block data pointer -> the block's handle

    def __call__(self, view: torch.Tensor) -> Handle:
        storage = view.untyped_storage()
        key = storage.data_ptr()
        if key not in self.blocks:
            whole = torch.empty(0, dtype=torch.uint8, device=view.device).set_(storage)
            self.blocks[key] = self.export_block(whole)
        return {uuid: retarget(args, view) for uuid, args in self.blocks[key].items()}

    def clear(self) -> None:
        self.blocks.clear()


class IpcStaging:
    """Blocks of memory on one device, kept across publications; see the module doc."""

    def __init__(self, exporter: Callable[[torch.Tensor], Handle] | None = None, *,
                 block_bytes: int = BLOCK_BYTES) -> None:
        self.exporter = exporter if exporter is not None else CudaBlockExports()
        self.block_bytes = block_bytes
        self.blocks: list[torch.Tensor] = []  # uint8, one dimension each

    def place(self, meta: Iterable[tuple[str, str, list[int]]], device: torch.device | str | None = None
              ) -> list[torch.Tensor]:
        """Views for (name, dtype name, shape) entries, in order, laid out as the module doc says
        (their contents are whatever the last publication left there)."""
        device = torch.device(device) if device is not None else self._device()
        cursor = _Cursor()
        return [self._slot(cursor, to_dtype(dtype), list(shape), device) for _, dtype, shape in meta]

    def handles(self, views: list[torch.Tensor]) -> list[Handle]:
        return [self.exporter(v) for v in views]

    def export(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> tuple[list, list[Handle], list[torch.Tensor]]:
        """Copy each (name, tensor) into the staging blocks, in order: (metadata [(name, dtype name,
        shape)], one handle per tensor, the staged views).  Consumed lazily: a source's tensor can be
        freed once copied."""
        meta, handles, views = [], [], []
        cursor = _Cursor()
        for name, tensor in pairs:
            src = tensor.detach()
            view = self._slot(cursor, src.dtype, list(src.shape), src.device)
            view.copy_(src)
            meta.append((name, dtype_name(view.dtype), list(view.shape)))
            handles.append(self.exporter(view))
            views.append(view)
        return meta, handles, views

    def release(self) -> None:
        """Free every block (after every engine dropped its views: the transport's close)."""
        self.blocks = []
        if isinstance(self.exporter, CudaBlockExports):
            self.exporter.clear()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks)

    def _device(self) -> torch.device:
        if self.blocks:
            return self.blocks[0].device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _slot(self, cursor: "_Cursor", dtype: torch.dtype, shape: list[int], device: torch.device) -> torch.Tensor:
        """The next view of `dtype` and `shape`: in the current block when it has room, else at the
        start of the next one (made, or remade larger, when missing or too small)."""
        nbytes = prod(shape) * torch.empty(0, dtype=dtype).element_size()
        start = -(-cursor.offset // ALIGN) * ALIGN
        if cursor.block >= len(self.blocks) or start + nbytes > self.blocks[cursor.block].numel():
            cursor.block, start = cursor.block + 1 if cursor.offset else cursor.block, 0
            if cursor.block < len(self.blocks) and nbytes > self.blocks[cursor.block].numel():
                self._drop_from(cursor.block)  # a larger tensor than last time: this block and later ones go
            if cursor.block == len(self.blocks):
                self.blocks.append(torch.empty(max(self.block_bytes, nbytes), dtype=torch.uint8, device=device))
        block = self.blocks[cursor.block]
        assert block.device == torch.device(device), f"staging holds {block.device}, a tensor is on {device}"
        cursor.offset = start + nbytes
        return block[start:start + nbytes].view(dtype).view(shape)

    def _drop_from(self, index: int) -> None:
        dropped, self.blocks = self.blocks[index:], self.blocks[:index]
        if isinstance(self.exporter, CudaBlockExports):
            for block in dropped:
                self.exporter.blocks.pop(block.untyped_storage().data_ptr(), None)


class _Cursor:
    """Where the next staged tensor goes: a block index and a byte offset in it."""

    def __init__(self) -> None:
        self.block, self.offset = 0, 0
