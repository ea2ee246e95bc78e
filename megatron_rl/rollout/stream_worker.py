"""StreamWorkerExtension: what a StreamEngine adds inside vLLM's worker processes.

    StreamEngine.start(cfg)  # names it as vLLM's worker_extension_cls; then, from the client:
    await stream.engine.collective_rpc("megatron_rl_load_checkpoint", args=(model_dir,))

The publication hooks (checked, all-or-nothing commits: publish/vllm_engine.py) plus a loader of a
whole HF checkpoint directory, used by tests and experiments/kv_refit_probe.py to swap weights mid-generation.
"""

from __future__ import annotations

from megatron_rl.publish.vllm_engine import PublicationWorkerExtension
from megatron_rl.publish.vllm_reload import checkpoint_tensors, reload_weights


class StreamWorkerExtension(PublicationWorkerExtension):
    """vLLM worker extension of a StreamEngine: the publication hooks plus a checkpoint loader."""

    def megatron_rl_load_checkpoint(self, model_dir: str) -> float:
        """Load every tensor of the HF checkpoint in `model_dir` into the serving model (layerwise
        reload, as a publication does); returns the new parameter sum."""
        reload_weights(self.model_runner.get_model(), self.model_runner.model_config, checkpoint_tensors(model_dir))
        return self.megatron_rl_weight_checksum()
