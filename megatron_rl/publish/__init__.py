"""Weight publication from the trainer to rollout engines (versioned, checksummed).

    from megatron_rl.publish import WeightPublisher, PublicationManifest

CPU: our gloo protocol (`wire`), received in vLLM by the "megatron_rl_gloo" backend
(`vllm_engine`).  GPU: vLLM's NCCL weight-transfer backend, unchanged.
"""

from __future__ import annotations

from megatron_rl.lazy_names import lazy_names

_WHERE = {"BucketSpec": "manifest", "PublicationError": "manifest", "PublicationManifest": "manifest",
          "TensorSpec": "manifest", "PublicationReport": "trainer", "WeightPublisher": "trainer"}
"""The package's names, loaded on first use (PEP 562): a pure-Python module of the package (e.g. transport)
is imported without torch."""

__all__ = sorted(_WHERE)

__getattr__ = lazy_names(__name__, _WHERE)
