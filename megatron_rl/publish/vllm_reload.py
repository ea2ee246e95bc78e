"""Loading whole weights into a serving vLLM model: a publication's, a rollback's, or a checkpoint's.

    reload_weights(model, model_config, checkpoint_tensors(model_dir))   # inside a vLLM worker
    weights = FullWeights(model, model_config, shapes)   # a full-weights run's versions on an engine worker

After vLLM's layerwise reload, CPU MoE experts are re-prepared (publish/vllm_moe.py) and so is a
tied LM head (`refresh_tied_heads`).  Tested by tests/e2e/test_moe_reload.py and, for the tied head,
tests/e2e/test_publish_from_learner.py.

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
    refresh_tied_heads(model)
    if torch.cuda.is_available():
        # The staged tensors may live on other streams (NCCL path): finish every copy out of
        # them before they are freed and their memory reused.
        torch.cuda.synchronize()


def refresh_tied_heads(model: torch.nn.Module) -> int:
    """Re-prepare every unquantized LM head whose weight is an embedding's (tied embeddings,
    e.g. Qwen2.5-1.5B), and that embedding, from the weight the reload just wrote; returns how many
    layers.

    The layerwise reload processes a layer when its own tensors arrive.  A tied head gets none (the
    checkpoint and every publication hold only `model.embed_tokens.weight`): vLLM puts its
    parameter back, which the embedding's reload has overwritten in place, but not what its
    `process_weights_after_loading` derived from it at start-up.  On CPU that is a prepacked
    oneDNN (or AMX) copy of the weight behind `cpu_linear`, so without this the engine embeds
    tokens with the new weights and computes logits with the start-up ones (vLLM 0.32; measured
    3.8 nats off after a reload).  On GPU the head reads its weight directly and this is a no-op."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    holders: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            holders.setdefault(id(weight), []).append(module)
    # Every holder of a shared weight, the embedding too (whichever of them the reload loaded).
    tied = [m for group in holders.values() if len(group) > 1 for m in group
            if isinstance(getattr(m, "quant_method", None), UnquantizedEmbeddingMethod)]
    for module in tied:
        module.quant_method.process_weights_after_loading(module)
    return len(tied)


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


class FullWeights:
    """A full-weights run's kind of weights on one engine worker: a version is the model's own tensors, loaded in
    place, and the version served before it is kept to roll back to (a host copy, or the checkpoint on disk).
    Its sibling is a LoRA run's AdapterStore (publish/vllm_adapters.py: a version is an adapter beside the
    unchanged base); VerifiedCommit asks either the same things and never which one it holds."""

    def __init__(self, model, model_config, shapes: dict[str, tuple[int, ...]] | None):
        self.model, self.model_config = model, model_config
        self.shapes = shapes  # what a publication must hold (expected_tensors), None: checked by checksums only
        self.rollback_tensors: list[tuple[str, torch.Tensor]] | None = None  # host copy of the serving version
        self.rollback_from_disk = True  # nothing published yet: the serving version is the checkpoint

    def install(self, version: int, tensors) -> None:
        reload_weights(self.model, self.model_config, tensors)

    def keep(self, loaded: list[tuple[str, torch.Tensor]] | None, keep_copy: bool) -> None:
        """The group accepted `loaded`: it is now the version to roll back to (a host copy, or none at all)."""
        self.rollback_from_disk = False
        if not keep_copy or loaded is None:
            self.rollback_tensors = None
            return
        names = [n for n, _ in loaded]
        if self.rollback_tensors is None or [n for n, _ in self.rollback_tensors] != names:
            self.rollback_tensors = [(n, t.detach().to("cpu", copy=True)) for n, t in loaded]
            return
        for (_, dst), (_, src) in zip(self.rollback_tensors, loaded):
            dst.copy_(src)

    def roll_back(self, version: int, feed) -> None:
        """Version `version` failed to load somewhere in the group: reload the one served before it (through
        `feed`, the commit's tensor stream); raises if none is kept."""
        if self.rollback_tensors is not None:
            source = iter(self.rollback_tensors)
        elif self.rollback_from_disk:
            source = checkpoint_tensors(self.model_config.model)
        else:
            raise RuntimeError("no rollback copy is kept (rollout.keep_rollback_copy is false)")
        self.install(version, feed(source))

    def restore(self) -> None:
        """Nothing to put back after a weight update session: the loaded tensors are the model's."""
