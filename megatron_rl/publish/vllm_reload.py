"""Loading whole weights into a serving vLLM model: a publication's, a rollback's, or a checkpoint's.

    reload_weights(model, model_config, checkpoint_tensors(model_dir))   # inside a vLLM worker

Used by publish/vllm_engine.py (every publication and rollback of full weights) and by the streaming
worker's reload of the version-0 checkpoint (rollout/stream_worker.py).
"""

from __future__ import annotations

import torch


def reload_weights(model: torch.nn.Module, model_config, tensors) -> None:
    """Load (HF name, tensor) pairs into a serving vLLM model through its layerwise reload,
    with the MoE kernels re-prepared from the new weights (publish/vllm_moe.py)."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from megatron_rl.publish.vllm_moe import disarm_moe_kernels, rearm_moe_kernels

    disarm_moe_kernels(model)
    initialize_layerwise_reload(model)
    with disable_mtp_completeness_check():
        model.load_weights(tensors)
    finalize_layerwise_reload(model, model_config)
    rearm_moe_kernels(model)
    if torch.cuda.is_available():
        # The staged tensors may live on other streams (NCCL path): finish every copy out of
        # them before they are freed and their memory reused.
        torch.cuda.synchronize()


def checkpoint_tensors(model_dir: str):
    """(name, tensor) of every tensor in a HF checkpoint directory's safetensors files."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir} to roll back to")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
