"""Platform detection, layer specs, and the CPU compatibility layer for Megatron-Core.

    python -m pytest tests/unit/test_platform.py -q

The compat tests run Megatron's covered path (GPTModel forward/backward through
get_forward_backward_func, Megatron DDP, the distributed optimizer with gradient clipping) in a
fresh Python process, once WITH enable_cpu_compat() and once WITHOUT: the first must finish with
every kind of redirect observed (a CPU-only torch raises on any CUDA call that escapes), the
second must fail on CUDA, which shows the test exercises what the layer fixes.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_rl.platform import Platform, detect_platform, layer_spec

# The fast tier (`-m unit`) is given by tests/unit/conftest.py: every test here but the slow ones.

COVERED_PATH = textwrap.dedent('''
    import json, os, sys, torch, torch.distributed as dist
    from functools import partial
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    torch.set_num_threads(1)
    if sys.argv[1] == "compat":
        from megatron_rl.platform.cpu_compat import enable_cpu_compat, redirect_counts
        assert enable_cpu_compat() and enable_cpu_compat()   # idempotent
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.platform import detect_platform
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    cfg = {"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    if len(sys.argv) > 3:  # Megatron's MoE layer (router, allgather dispatcher, SequentialMLP experts)
        cfg.update(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                   norm_topk_prob=True)
        if sys.argv[3] == "moe_unbound":  # undo compat item 5 only
            import megatron.core.transformer.moe.moe_utils as moe_utils
            del moe_utils.te_general_gemm
    cfg = load_hf_config(cfg)
    model = build_gpt_model(cfg, platform=detect_platform("cpu"), tp=1, pp=1)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, clip_grad=1.0, use_distributed_optimizer=True), [ddp])
    model.config.finalize_model_grads_func = finalize_model_grads
    tokens = torch.randint(0, 50, (2, 8))
    def step(it, m):
        t = next(it)
        out = m(t, torch.arange(8).expand_as(t), attention_mask=None)
        return out, lambda o: (o.float().pow(2).mean(), {})
    ddp.zero_grad_buffer(); opt.zero_grad()
    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([tokens]), model=[ddp],
                                num_microbatches=1, seq_length=8, micro_batch_size=2)
    ok, norm, _ = opt.step()
    print("RESULT" + json.dumps({"ok": bool(ok), "norm": float(norm), "counts": redirect_counts()}))
''')


def _run_covered(mode: str, *model: str) -> subprocess.CompletedProcess:
    # port 0: the OS picks the rendezvous port while binding it (no other process can take it first)
    return subprocess.run([sys.executable, "-c", COVERED_PATH, mode, "0", *model], capture_output=True,
                          text=True, timeout=240, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                                       "PYTHONPATH": ":".join(p for p in sys.path if p)})


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU compat layer is for CPU-only torch")
def test_megatron_covered_path_runs_on_cpu_only_with_compat():
    with_compat = _run_covered("compat")
    assert with_compat.returncode == 0, with_compat.stderr[-3000:]
    line = next(l for l in with_compat.stdout.splitlines() if l.startswith("RESULT"))
    result = json.loads(line[len("RESULT"):])
    assert result["ok"] and result["norm"] > 0
    # every kind of CUDA reach we redirect was exercised by this path
    for kind in ("current_device", "device_kwarg", "tensor.type"):
        assert result["counts"].get(kind, 0) > 0, (kind, result["counts"])

    without = _run_covered("plain")
    assert without.returncode != 0, "Megatron ran on CPU without the compat layer: the test no longer proves it"
    assert "not compiled with cuda" in without.stderr.lower(), without.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU compat layer is for CPU-only torch")
def test_megatron_moe_layer_trains_on_cpu_with_compat():
    """A MoE model steps with the compat layer; without its item 5 the router gating raises NameError."""
    with_compat = _run_covered("compat", "moe")
    assert with_compat.returncode == 0, with_compat.stderr[-3000:]
    result = json.loads(next(l for l in with_compat.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
    assert result["ok"] and result["norm"] > 0
    unbound = _run_covered("compat", "moe_unbound")
    assert unbound.returncode != 0 and "te_general_gemm" in unbound.stderr, unbound.stderr[-2000:]


def test_detect_platform_cpu_defaults_and_overrides():
    p = detect_platform("cpu")
    assert p == Platform(device=torch.device("cpu"), backend="gloo", dtype=torch.float32, use_te=False)
    assert p.is_cpu and p.dtype_name == "fp32"
    assert detect_platform("cpu", "bf16").dtype == torch.bfloat16
    if not torch.cuda.is_available():
        auto = detect_platform()
        assert auto.is_cpu and auto.backend == "gloo"


@pytest.mark.parametrize("kwargs,match", [({"device": "tpu"}, "tpu"), ({"dtype": "fp8"}, "fp8")])
def test_detect_platform_rejects_unknown(kwargs, match):
    with pytest.raises(ValueError, match=match):
        detect_platform(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_detect_platform_cuda_without_gpu_is_an_error():
    with pytest.raises(ValueError, match="cuda"):
        detect_platform("cuda")


def test_layer_spec_cpu_uses_local_rmsnorm_modules():
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = layer_spec(detect_platform("cpu"))
    sub = spec.submodules
    assert sub.input_layernorm is WrappedTorchNorm and sub.pre_mlp_layernorm is WrappedTorchNorm
    assert sub.self_attention.submodules.linear_qkv is ColumnParallelLinear
    assert sub.self_attention.submodules.q_layernorm.__name__ == "IdentityOp"


def test_cpu_compat_device_mapping_rules():
    from megatron_rl.platform.cpu_compat import _is_cuda_device

    for dev in ("cuda", "cuda:1", torch.device("cuda", 0), 0, 3):
        assert _is_cuda_device(dev), dev
    for dev in ("cpu", torch.device("cpu"), None, True, "meta"):
        assert not _is_cuda_device(dev), dev


def test_shard_state_dict_tp_pp_rules():
    from megatron_rl.models.reshard import shard_state_dict

    g = torch.Generator().manual_seed(0)
    full = {
        "embedding.word_embeddings.weight": torch.randn(256, 8, generator=g),
        "decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(16, 8, generator=g),
        "decoder.layers.1.mlp.linear_fc1.weight": torch.randn(12, 8, generator=g),  # [gate(6); up(6)]
        "decoder.layers.1.mlp.linear_fc2.weight": torch.randn(8, 6, generator=g),
        "decoder.layers.1.input_layernorm.weight": torch.randn(8, generator=g),
        "decoder.final_layernorm.weight": torch.randn(8, generator=g),
    }
    kw = dict(tp=2, pp=2, num_layers=2, tie_word_embeddings=True)
    s = {(t, p): shard_state_dict(full, tp_rank=t, pp_rank=p, **kw) for t in (0, 1) for p in (0, 1)}
    # stage 0: embedding + layer 0; stage 1: layer 1 renumbered to 0, final norm, tied output copy
    assert set(s[0, 0]) == {"embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight"}
    assert "decoder.layers.0.mlp.linear_fc1.weight" in s[0, 1] and "output_layer.weight" in s[0, 1]
    torch.testing.assert_close(torch.cat([s[0, 0]["embedding.word_embeddings.weight"],
                                          s[1, 0]["embedding.word_embeddings.weight"]]),
                               full["embedding.word_embeddings.weight"])
    torch.testing.assert_close(s[1, 1]["output_layer.weight"], full["embedding.word_embeddings.weight"][128:])
    fc1 = full["decoder.layers.1.mlp.linear_fc1.weight"]
    torch.testing.assert_close(s[1, 1]["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([fc1[3:6], fc1[9:12]]))
    torch.testing.assert_close(s[1, 1]["decoder.layers.0.mlp.linear_fc2.weight"],
                               full["decoder.layers.1.mlp.linear_fc2.weight"][:, 3:])
    torch.testing.assert_close(s[1, 1]["decoder.layers.0.input_layernorm.weight"],
                               full["decoder.layers.1.input_layernorm.weight"])
    repadded = shard_state_dict(full, tp_rank=0, pp_rank=0, tp=1, pp=1, num_layers=2, tie_word_embeddings=False,
                                vocab_size=100)
    assert repadded["embedding.word_embeddings.weight"].shape == (128, 8)
    assert repadded["embedding.word_embeddings.weight"][100:].abs().sum() == 0
    with pytest.raises(ValueError, match="num_layers 2"):
        shard_state_dict(full, tp_rank=0, pp_rank=0, tp=1, pp=3, num_layers=2, tie_word_embeddings=False)
    uneven = dict(full, **{"decoder.layers.1.mlp.linear_fc2.weight": torch.randn(8, 5, generator=g)})
    with pytest.raises(ValueError, match="linear_fc2.weight: dim 1 of size 5 does not split over TP=2"):
        shard_state_dict(uneven, tp_rank=0, pp_rank=1, **kw)  # not a silently shorter shard on one rank


def test_heavy_ray_actors_run_at_normal_priority_options():
    from megatron_rl.platform.priority import with_normal_priority

    opts = with_normal_priority({"num_cpus": 1})
    assert opts == {"num_cpus": 1, "runtime_env": {"env_vars": {"RAY_worker_niceness": "0"}}}
    mine = with_normal_priority({"runtime_env": {"env_vars": {"RAY_worker_niceness": "5", "X": "1"}, "pip": []}})
    assert mine["runtime_env"] == {"env_vars": {"RAY_worker_niceness": "5", "X": "1"}, "pip": []}


BACKWARD_ALLOCATES = textwrap.dedent('''
    import json, torch
    from megatron_rl.platform.cpu_compat import enable_cpu_compat, redirect_counts
    assert enable_cpu_compat()

    class GatherLike(torch.autograd.Function):  # as Megatron's EP all-gather: backward allocates
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            out = torch.empty(g.shape, dtype=g.dtype, device=torch.cuda.current_device())
            return out.copy_(g) * 2

    x = torch.ones(3, requires_grad=True)
    torch.autograd.backward(GatherLike.apply(x).sum())
    y = torch.ones(2, requires_grad=True)
    torch.autograd.backward([GatherLike.apply(y)], grad_tensors=[torch.full((2,), 3.0)], retain_graph=False)
    print("RESULT" + json.dumps({"x": x.grad.tolist(), "y": y.grad.tolist(), "counts": redirect_counts()}))
''')


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU compat layer is for CPU-only torch")
def test_cpu_compat_backward_runs_with_the_mode_on():
    """Compat item 6: a backward pass that allocates on the current device (Megatron's EP dispatcher)."""
    proc = subprocess.run([sys.executable, "-c", BACKWARD_ALLOCATES], capture_output=True, text=True, timeout=120,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": ":".join(p for p in sys.path if p)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
    assert result["x"] == [2.0] * 3 and result["y"] == [6.0] * 2
    assert result["counts"]["backward"] == 2


def test_cpu_compat_torch_norm_under_sequence_parallelism():
    """Compat item 7: WrappedTorchNorm (no Apex, no TE) builds under sequence_parallel and marks its weight
    for finalize_model_grads' TP sum; without sequence parallelism it is built as before, unmarked."""
    import types

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_rl.platform.cpu_compat import _allow_sequence_parallel_torch_norm

    fields = dict(layernorm_zero_centered_gamma=False, persist_layer_norm=False, memory_efficient_layer_norm=False,
                  normalization="RMSNorm")
    sp, plain = (types.SimpleNamespace(sequence_parallel=flag, **fields) for flag in (True, False))
    _allow_sequence_parallel_torch_norm()
    _allow_sequence_parallel_torch_norm()  # idempotent: one wrapper
    norm = WrappedTorchNorm(config=sp, hidden_size=8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
    assert sp.sequence_parallel is True  # the caller's config is left as it was
    other = WrappedTorchNorm(config=plain, hidden_size=8, eps=1e-6)
    assert not hasattr(other.weight, "sequence_parallel")
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), other(x), rtol=0, atol=0)
