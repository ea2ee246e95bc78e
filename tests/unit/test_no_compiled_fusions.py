"""GPU configs take Megatron's eager path instead of its torch.compile'd fusions (issue 18, GPU defaults).

    python -m pytest tests/unit/test_no_compiled_fusions.py -q

Megatron-Core's bias-SwiGLU and bias-dropout-add fusions are decorated with megatron.core.jit's
jit_fuser (torch.compile on torch >= 2.2) and recompile for new sequence lengths.  The config a GPU
learner gets (cuda, bf16, Transformer Engine) is built here without a GPU and must select neither.
"""

import pytest
import torch

from megatron_rl.models.builder import build_transformer_config
from megatron_rl.models.hf_config import load_hf_config
from megatron_rl.platform import Platform

pytestmark = pytest.mark.unit

TINY = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}


@pytest.mark.parametrize("use_te", [True, False])
def test_gpu_config_uses_no_compiled_fusion(use_te):
    gpu = Platform(device=torch.device("cuda", 0), backend="nccl", dtype=torch.bfloat16, use_te=use_te)
    cfg = build_transformer_config(load_hf_config(TINY), tp=1, pp=1, platform=gpu)
    assert (cfg.bias_activation_fusion, cfg.bias_dropout_fusion, cfg.masked_softmax_fusion) == (False, False, False)
    assert cfg.bf16 and cfg.gated_linear_unit
