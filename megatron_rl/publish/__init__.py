"""Weight publication from the trainer to rollout engines (versioned, checksummed).

    from megatron_rl.publish import WeightPublisher, PublicationManifest

CPU: our gloo protocol (`wire`), received in vLLM by the "megatron_rl_gloo" backend
(`vllm_engine`).  GPU: vLLM's NCCL weight-transfer backend, unchanged.
"""

from megatron_rl.publish.manifest import BucketSpec, PublicationError, PublicationManifest, TensorSpec
from megatron_rl.publish.trainer import PublicationReport, WeightPublisher

__all__ = ["BucketSpec", "PublicationError", "PublicationManifest", "TensorSpec", "PublicationReport", "WeightPublisher"]
