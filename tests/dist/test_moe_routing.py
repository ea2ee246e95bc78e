"""Routing replay on a Qwen3-MoE learner (EP2, gloo): with replay on, the experts the learner routes
to equal the recorded ones; the mismatch metric counts exactly the tokens whose routing was changed.

    python -m pytest tests/dist/test_moe_routing.py -q

The experts the model really used are observed independently of the replay machinery: a forward
hook on every router keeps its routing map ([T*B, E] booleans that the token dispatcher consumes).
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.models.routing import routing_mismatch
from megatron_rl.platform.spawn import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

B, T = 2, 12


def _observed_experts(maps: list, k: int) -> torch.Tensor:
    """Router routing maps (per layer [T*B, E] bool) -> [B, T, L, k] sorted expert indices."""
    from megatron_rl.models.routing import rows_to_btlk

    rows = [m.nonzero()[:, 1].reshape(m.shape[0], k) for m in maps]  # nonzero is row-major: sorted per row
    return rows_to_btlk(rows, B)


def _replay_rank(rank: int, world: int, hf_dir: str) -> list[dict]:
    """The replay case on the plain model, then on the same model with LoRA adapters on its attention (issue 45
    item 5: LoRA and routing replay compose; the experts take no adapters)."""
    from megatron_rl.models.lora import LoraConfig

    return [_replay_case(world, hf_dir, lora) for lora in (None, LoraConfig(enabled=True, rank=4,
                                                                               target_modules=["qkv", "proj"]))]


def _replay_case(world: int, hf_dir: str, lora) -> dict:
    from megatron_rl.conversion.hf_io import HFCheckpoint
    from megatron_rl.conversion.model_io import fill_from_hf
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.hf_config import load_hf_config, padded_vocab_size
    from megatron_rl.models.lora import adapter_parameters
    from megatron_rl.models.routing import moe_routers, record_routing, replay_routing
    from megatron_rl.platform import detect_platform
    from megatron_rl.platform.parallel import parallel_scope

    cfg = load_hf_config(hf_dir)
    k, E = cfg.moe.top_k, cfg.moe.num_experts
    tokens = torch.randint(0, 100, (B, T), generator=torch.Generator().manual_seed(7))
    pos = torch.arange(T).unsqueeze(0).expand(B, T)
    with parallel_scope(tp=1, pp=1, ep=world):
        model = build_gpt_model(cfg, platform=detect_platform("cpu", "fp32"), tp=1, pp=1, parallel_output=False,
                                perform_initialization=False, routing_replay=True, lora=lora)
        fill_from_hf(model, cfg, HFCheckpoint(hf_dir, cfg), 0, 1, padded_vocab_size(cfg.vocab_size, 1))
        maps: list = []
        for router in moe_routers(model):
            router.register_forward_hook(lambda mod, inp, out: maps.append(out[1].detach().clone()))
        with record_routing(model) as rec:
            natural = model(tokens, pos, attention_mask=None)
        recorded = rec.experts(batch=B)  # [B, T, L, k]
        observed = _observed_experts(maps, k)
        # The "engine" routed a third of the tokens elsewhere in layer 0: each such token's experts shift by one.
        engine = recorded.clone()
        changed = torch.zeros(B, T, dtype=torch.bool)
        changed[:, ::3] = True
        engine[:, :, 0, :][changed] = (engine[:, :, 0, :][changed] + 1) % E
        maps.clear()
        with replay_routing(model, engine):
            replayed = model(tokens, pos, attention_mask=None)
            # The replayed path is differentiable (the router gets gradients).  Backward as Megatron's
            # schedules run it (custom_backward): Tensor.backward would leave cpu_compat's device
            # mode, which is off inside its own handler, for the dispatcher's backward all-gather.
            from megatron.core.pipeline_parallel.schedules import custom_backward

            loss = replayed.float().sum()
            custom_backward(loss, torch.ones_like(loss))
        used = _observed_experts(maps, k)
        router_grad = float(sum(r.weight.grad.abs().sum() for r in moe_routers(model) if r.weight.grad is not None))
        adapter_grad = float(sum(p.grad.abs().sum() for p in adapter_parameters(model).values() if p.grad is not None))
        maps.clear()
        after = model(tokens, pos, attention_mask=None)  # replay is off again outside the block
        with pytest.raises(ValueError, match="top_k"):
            with replay_routing(model, engine[..., :1]):
                pass
    return {"recorded": recorded, "observed": observed, "engine": engine, "changed": changed, "used": used,
            "natural": natural.detach(), "replayed": replayed.detach(), "after": after.detach(),
            "router_grad": router_grad, "adapter_grad": adapter_grad, "adapters": len(adapter_parameters(model))}


def test_replay_forces_recorded_experts_and_metric_counts_changes(tmp_path):
    from megatron_rl.models.tiny import make_tiny_model

    hf = make_tiny_model(tmp_path / "hf", arch="qwen3_moe", seed=4)
    for plain, lora in run_distributed(_replay_rank, 2, str(hf)):
        assert plain["adapters"] == 0 and plain["router_grad"] > 0  # the base trains: the router gets gradients
        assert lora["adapters"] > 0 and lora["adapter_grad"] > 0 and lora["router_grad"] == 0  # base frozen
        assert torch.equal(lora["natural"], plain["natural"])  # adapters start as a no-op (B = 0)
        for r in (plain, lora):
            _check_replay(r)


def _check_replay(r: dict) -> None:
    assert torch.equal(r["recorded"].sort(-1).values, r["observed"])  # record = what the dispatcher used
    assert torch.equal(r["used"], r["engine"].sort(-1).values)  # replay: learner experts == recorded ones
    m = routing_mismatch(r["engine"], r["recorded"])
    assert m["tokens"] == B * T and m["token_share"] == pytest.approx(r["changed"].float().mean().item())
    assert m["layer_token_share"] == pytest.approx(m["token_share"] / 2)  # 2 layers, only layer 0 changed
    assert routing_mismatch(r["used"], r["engine"])["token_share"] == 0.0
    assert routing_mismatch(r["engine"], r["recorded"], mask_bt=~r["changed"])["token_share"] == 0.0
    assert (r["replayed"] - r["natural"]).abs().max() > 1e-3  # different experts, different logits
    assert torch.equal(r["after"], r["natural"])
