"""Build a Megatron-Core GPTModel (this process's pipeline stage) from an HFModelConfig (Llama / Qwen2 / Qwen3).

    platform = detect_platform()
    with parallel_scope(tp=2, pp=2):
        model = build_gpt_model(cfg, platform=platform, tp=2, pp=2)
        logits = model(tokens, position_ids, attention_mask=None)   # [B, T, V_padded / tp]

The mapping of Llama / Qwen2 semantics onto Megatron switches:
  SwiGLU MLP          -> gated_linear_unit=True, activation_func=silu, no compiled fusions (below)
  RMSNorm             -> normalization="RMSNorm", layernorm_epsilon=rms_norm_eps
  GQA                 -> num_query_groups=num_kv_heads, kv_channels=head_dim
  no linear biases    -> add_bias_linear=False; Qwen2's q/k/v bias -> add_qkv_bias=True
  RoPE (half-rotation)-> position_embedding_type="rope", rotary_base=rope_theta, not interleaved
  Llama-3.x rope_type llama3 -> rope_scaling=True, rope_scaling_factor=factor; GPTModel passes only the
                        factor, so the inverse frequencies are recomputed with the checkpoint's
                        low/high_freq_factor and original_max_position_embeddings (Megatron's own
                        RotaryEmbedding._apply_scaling, which follows transformers' llama3 rule)
  Qwen3 q/k RMSNorm   -> qk_layernorm=True in the layer spec and the config (over head_dim, before
                        RoPE, as in HF; the config flag makes Megatron sum its grads over TP);
                        head_dim is kv_channels, independent of hidden_size / num_heads
  tied embeddings     -> share_embeddings_and_output_weights=tie_word_embeddings
  Qwen3-MoE experts   -> num_moe_experts, moe_router_topk, moe_ffn_hidden_size; router "softmax then
                        top-k, renormalised when norm_topk_prob" = Megatron's top-k on the logits then a
                        softmax over the k kept (moe_router_pre_softmax=False; softmax is monotonic, and
                        a softmax over a subset is the renormalised full softmax); without
                        norm_topk_prob, softmax over all experts first (pre_softmax=True).  Router in
                        fp32, no aux/z loss, no capacity (every token reaches its k experts), allgather
                        token dispatcher (gloo-safe), expert parallel ep, expert TP = tp.
                        moe_enable_routing_replay lets the learner force recorded experts (routing.py).
Dropout is off: RL post-training compares logprobs of the same policy across engines.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from megatron_rl.models.hf_config import HFModelConfig, check_parallel_layout, padded_vocab_size
from megatron_rl.models.lora import LoraConfig, adapt
from megatron_rl.platform import Platform, block_spec

logger = logging.getLogger(__name__)


def moe_config_fields(cfg: HFModelConfig, *, ep: int = 1, routing_replay: bool = False) -> dict:
    """TransformerConfig fields of Qwen3-MoE's MoE layers ({} for a dense model); see the module doc."""
    if cfg.moe is None:
        if routing_replay:
            raise ValueError(f"routing replay needs a MoE model; {cfg.arch} is dense")
        return {}
    m = cfg.moe
    return dict(
        num_moe_experts=m.num_experts,
        moe_router_topk=m.top_k,
        moe_ffn_hidden_size=m.ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not m.norm_topk_prob,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep,
        moe_enable_routing_replay=routing_replay,
    )


def build_transformer_config(cfg: HFModelConfig, *, tp: int, pp: int, platform: Platform, ep: int = 1,
                             routing_replay: bool = False, **overrides):
    """Megatron TransformerConfig for `cfg` at TP=tp, PP=pp (EP=ep for MoE) on `platform`.

    `overrides` set further TransformerConfig fields (e.g. recompute_granularity) verbatim.
    """
    from megatron.core.transformer import TransformerConfig

    check_parallel_layout(cfg, tp, pp, dp=ep, ep=ep)
    dtype = platform.dtype
    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size if cfg.moe is None else cfg.moe.ffn_hidden_size,
        num_attention_heads=cfg.num_heads,
        num_query_groups=cfg.num_kv_heads,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        # Besides the layer spec: finalize_model_grads sums q/k_layernorm grads over TP only when set
        # (each TP rank normalises its own heads with the one replicated weight).
        qk_layernorm=cfg.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True,
        # Megatron's bias-SwiGLU and bias-dropout-add fusions are torch.compile'd (megatron.core.jit),
        # which recompiles for new sequence lengths -- and RL batches change length every step.  With
        # no linear biases and no dropout they would fuse only elementwise ops: the eager path is
        # used on every platform (TE's own kernels -- attention, norms, GEMMs -- are unaffected).
        bias_activation_fusion=False,
        masked_softmax_fusion=False,  # needs Megatron's compiled softmax kernels; TE has its own
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=platform.is_cpu,
        init_method_std=float(cfg.raw.get("initializer_range", 0.02)),
    )
    kwargs.update(moe_config_fields(cfg, ep=ep, routing_replay=routing_replay))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(cfg: HFModelConfig, *, platform: Platform, tp: int, pp: int, parallel_output: bool = True,
                    config=None, lora: LoraConfig | None = None, **config_overrides):
    """GPTModel holding this rank's TP shard of this rank's pipeline stage (parallel state must be up).

    parallel_output=True keeps logits vocab-parallel ([B, T, V_padded/tp]) for TP-aware losses.
    lora (enabled): the base is frozen and LoRA adapters sit beside its linear layers (models/lora.py);
    a combination the adapters do not support is a ValueError naming the key.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("build_gpt_model needs Megatron parallel state: use parallel_scope(tp, pp)")
    ep = ps.get_expert_model_parallel_world_size()
    if ps.get_tensor_model_parallel_world_size() != tp or ps.get_pipeline_model_parallel_world_size() != pp:
        raise ValueError(
            f"build_gpt_model(tp={tp}, pp={pp}) but parallel state is tp="
            f"{ps.get_tensor_model_parallel_world_size()}, pp={ps.get_pipeline_model_parallel_world_size()}"
        )
    config = config or build_transformer_config(cfg, tp=tp, pp=pp, platform=platform, ep=ep, **config_overrides)
    model = GPTModel(
        config=config,
        # the layers and the final norm, both from the platform (not Megatron's TE-if-importable final norm)
        transformer_layer_spec=block_spec(platform, cfg, config, ps.get_pipeline_model_parallel_rank()),
        vocab_size=padded_vocab_size(cfg.vocab_size, tp),
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling is not None,
        rope_scaling_factor=cfg.rope_scaling.factor if cfg.rope_scaling else 8.0,
    )
    if cfg.rope_scaling is not None:
        _set_llama3_inv_freq(model.rotary_pos_emb, cfg)
    adapt(model, lora, cfg, config, platform, tp=tp, tp_rank=ps.get_tensor_model_parallel_rank())  # LoRA: adapters
    if not platform.is_cpu:
        model.to(platform.device)
    logger.debug("built GPTModel stage %d/%d tp rank %d: %d params", ps.get_pipeline_model_parallel_rank(), pp,
                 ps.get_tensor_model_parallel_rank(), sum(p.numel() for p in model.parameters()))
    return model


def _set_llama3_inv_freq(rotary, cfg: HFModelConfig) -> None:
    """Give Megatron's RotaryEmbedding the llama3-scaled inverse frequencies of `cfg`'s rope_scaling."""
    rs = cfg.rope_scaling
    dim = cfg.head_dim
    base = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rotary.inv_freq.device) / dim))
    rotary.inv_freq = rotary._apply_scaling(
        base, factor=rs.factor, low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
        original_max_position_embeddings=rs.original_max_position_embeddings,
    )
    rotary.forward.cache_clear()  # RotaryEmbedding.forward is lru_cached on (seq len, offset)
