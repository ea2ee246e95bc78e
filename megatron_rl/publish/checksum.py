"""Checksums of published weights: how a bucket's bytes are hashed, on the tensors where they lie.

    from megatron_rl.publish.checksum import checksum_parts, raw_bytes
    digest = checksum_parts([raw_bytes(t) for t in tensors], "blocksum")   # hex, over the bytes in order

The sender hashes its tensors in place instead of packing a copy first; the receiver hashes the
flat buffer it received, cut at the manifest's offsets (publish/manifest.py `checksum`).

  "blocksum" (default)  each tensor's bytes cut into 4 KiB blocks, each block summed as 512
                        int64 words (wrapping), and blake3 over every tensor's length, block
                        sums and tail bytes.  Detects any changed word, and any missing,
                        stale, truncated or misplaced block; blind only to words swapped
                        inside one block.  ~11 GB/s on one core (a memory-bound torch sum),
                        so publication is not bound by hashing (benchmarks/bench_publish.py
                        prints each algorithm's cost side by side).
  "blake3"              cryptographic over every byte, ~4 GB/s here (the package comes with vLLM).
Both can be chosen: run.publish_checksum.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

CHECKSUMS = ("blocksum", "blake3")
DEFAULT_CHECKSUM = "blocksum"
BLOCK_BYTES = 4096


class _OverBytes:
    """A bytes hasher (blake3) fed uint8 CPU tensors."""

    def __init__(self, hasher) -> None:
        self._hasher = hasher

    def update(self, part: torch.Tensor) -> None:
        self._hasher.update(memoryview(part.cpu().numpy()))

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


class _BlockSum:
    """The "blocksum" digest (see the module docstring); update() takes uint8 tensors on any
    device (on a GPU the block sums are computed there and only they cross to the host)."""

    words = BLOCK_BYTES // 8

    def __init__(self) -> None:
        from blake3 import blake3

        self._digest = blake3()

    def update(self, part: torch.Tensor) -> None:
        n = part.numel()
        full = n - n % BLOCK_BYTES
        self._digest.update(n.to_bytes(8, "little"))
        if full:
            body = part[:full]
            if body.storage_offset() % 8:  # view(int64) needs 8-byte aligned offsets
                body = body.clone()
            sums = body.view(torch.int64).view(-1, self.words).sum(dim=1)  # [blocks], wraps on overflow
            self._digest.update(memoryview(sums.cpu().numpy()).cast("B"))
        if full < n:
            self._digest.update(memoryview(part[full:].cpu().numpy()))

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def new_hasher(algo: str):
    """An object with update(uint8 tensor) and hexdigest() for `algo`; all release the GIL."""
    if algo == "blocksum":
        return _BlockSum()
    if algo == "blake3":
        from blake3 import blake3

        return _OverBytes(blake3())
    raise ValueError(f"checksum algorithm {algo!r} is not one of {list(CHECKSUMS)}")


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor [nbytes] on its own device (no copy if contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 CPU tensor [nbytes]; no copy when it is contiguous on CPU."""
    return raw_bytes(t.to("cpu"))


def checksum_parts(parts: Iterable[torch.Tensor], algo: str) -> str:
    """Checksum (hex) of a bucket given as its tensors' bytes (uint8 tensors, in order)."""
    hasher = new_hasher(algo)
    for part in parts:
        hasher.update(part)
    return hasher.hexdigest()
