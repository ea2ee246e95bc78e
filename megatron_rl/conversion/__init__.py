"""Checkpoint conversion between Hugging Face (Llama / Qwen2) and Megatron-Core.

    megatron-rl convert hf-to-mcore --hf MODEL_DIR --out MCORE_DIR --tp 2 --pp 2
    megatron-rl convert mcore-to-hf --mcore MCORE_DIR --out HF_DIR
    megatron-rl convert verify --hf MODEL_DIR --mcore MCORE_DIR --tp 2

Modules: mapping (the shared name/layout mapping, pure), hf_io (safetensors read/write, atomic
output dirs), dist_ckpt (Megatron-Core's torch_dist format, written and read tensor by tensor),
model_io (a live GPTModel under canonical names, loading a checkpoint into it, manifest),
hf_to_mcore, mcore_to_hf, verify (logit parity), cli.
"""
