"""A reload into a tied-embedding vLLM model re-prepares the LM head (publish/vllm_reload.refresh_tied_heads).

    python -m pytest tests/unit/test_tied_head_reload.py -q

vLLM's CPU LM head computes logits with a copy of its weight made at load time (`cpu_linear`,
oneDNN-prepacked).  A tied head shares the embedding's Parameter and receives no tensor of its
own in a reload, so the in-place update of that Parameter does not reach its logits until
`refresh_tied_heads` rebuilds the copy.  Two real `UnquantizedEmbeddingMethod` layers, no engine;
the whole path through a publication is tests/e2e/test_publish_from_learner.py (the tied qwen3 case).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit


def _layer(weight: torch.nn.Parameter) -> torch.nn.Module:
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    layer = torch.nn.Module()
    layer.weight = weight
    layer.quant_method = UnquantizedEmbeddingMethod()
    layer.quant_method.process_weights_after_loading(layer)  # what vLLM's first load does
    return layer


def test_tied_head_serves_the_reloaded_embedding():
    from vllm.platforms import current_platform

    from megatron_rl.publish.vllm_reload import refresh_tied_heads

    if not current_platform.is_cpu():
        pytest.skip("only vLLM's CPU LM head keeps a prepacked copy of its weight")
    gen = torch.Generator().manual_seed(0)
    shared = torch.nn.Parameter(torch.randn(128, 64, generator=gen), requires_grad=False)
    model = torch.nn.Module()
    model.embed_tokens = _layer(shared)
    model.lm_head = _layer(shared)  # ParallelLMHead.tie_weights: the same Parameter
    model.other = _layer(torch.nn.Parameter(torch.randn(128, 64, generator=gen), requires_grad=False))
    x = torch.randn(3, 64, generator=gen)

    def logits(layer):
        return layer.quant_method.apply(layer, x)

    torch.testing.assert_close(logits(model.lm_head), x @ shared.T)
    shared.data.copy_(torch.randn(128, 64, generator=gen))  # the embedding's reload writes in place
    assert not torch.allclose(logits(model.lm_head), x @ shared.T, atol=1e-3)  # stale before the refresh
    other_before = logits(model.other)

    assert refresh_tied_heads(model) == 2  # the head and its embedding; the untied layer is left alone
    torch.testing.assert_close(logits(model.lm_head), x @ shared.T)
    torch.testing.assert_close(logits(model.other), other_before)
