"""MoE routing: record which experts a Megatron model routes each token to, replay given experts, and
measure how often two routings differ.

    model = build_gpt_model(cfg, ..., routing_replay=True)     # Megatron's RouterReplay on every router
    with record_routing(model) as rec:
        model(tokens_bt, position_ids, attention_mask=None)
    experts_btlk = rec.experts(batch=B)                        # [B, T, L_stage, k] int64, this stage's layers

    with replay_routing(model, engine_experts_btlk):           # e.g. what vLLM routed while sampling
        logits = model(tokens_bt, position_ids, attention_mask=None)   # every token uses those experts

    routing_mismatch(engine_experts_btlk, experts_btlk, mask_bt)   # share of tokens routed differently
    blob = encode_routing(experts_tlk); decode_routing(blob)      # compact form a trajectory carries

Routing replay (R3 in the literature: "rollout routing replay") makes the learner compute the
policy with the experts that generated the sample, so a token's logprob does not jump because a
router logit near a top-k boundary moved between the engine's kernels and the learner's.  With the
experts forced, the gate weights are the router's softmax over the *replayed* experts' logits
(Megatron gathers them; with norm_topk_prob that is HF's renormalised top-k), so the router still
gets gradients.  Megatron-Core 0.16 implements the forcing (`RouterReplay`, enabled by
`moe_enable_routing_replay`); this module drives it per model (not through its process-global
instance list, which keeps routers of models built earlier) and owns the layouts.

Shapes: B batch, T tokens, L MoE layers (of this pipeline stage, in layer order), k experts per
token.  Megatron routes hidden states [T, B, H] flattened to T*B rows (row = t * B + b);
trajectories and vLLM use [T, L, k] per sequence.  Sequence parallelism splits those rows over TP
ranks and is not supported here (MoE training at TP > 1 needs it: use TP 1 with EP for replay).
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def moe_routers(model) -> list:
    """The TopKRouter of each MoE layer of this stage, in layer order."""
    layers = _unwrap(model).decoder.layers
    routers = [layer.mlp.router for layer in layers if hasattr(layer.mlp, "router")]
    if not routers:
        raise ValueError("the model has no MoE layers (routing record/replay needs a MoE model)")
    return routers


def _replays(model) -> list:
    routers = moe_routers(model)
    if any(r.router_replay is None for r in routers):
        raise ValueError("routing replay is off in this model: build it with routing_replay=True "
                         "(TransformerConfig.moe_enable_routing_replay)")
    if getattr(routers[0].config, "sequence_parallel", False):
        raise ValueError("routing record/replay does not support sequence parallelism")
    return [r.router_replay for r in routers]


class RoutingRecord:
    """Experts chosen by each MoE layer of a stage during the forward passes inside `record_routing`."""

    def __init__(self, replays: list) -> None:
        self._replays = replays

    def rows(self) -> list[torch.Tensor]:
        """Per layer, [T*B, k] expert indices of the last forward pass (Megatron's row order)."""
        out = [r.get_recorded_indices() for r in self._replays]
        if any(t is None for t in out):
            raise RuntimeError("no forward pass was recorded inside record_routing")
        return [t.detach().cpu() for t in out]

    def experts(self, batch: int) -> torch.Tensor:
        """[B, T, L, k] expert indices of the last forward pass of a batch of `batch` sequences."""
        return rows_to_btlk(self.rows(), batch)


def rows_to_btlk(rows: list[torch.Tensor], batch: int) -> torch.Tensor:
    """Per-layer [T*B, k] (row t*B + b) -> [B, T, L, k]."""
    per_layer = []
    for t in rows:
        if t.shape[0] % batch:
            raise ValueError(f"{t.shape[0]} routed rows do not split into batch {batch}")
        per_layer.append(t.reshape(t.shape[0] // batch, batch, t.shape[1]).transpose(0, 1))  # [B, T, k]
    return torch.stack(per_layer, dim=2)


def btlk_to_rows(experts_btlk: torch.Tensor) -> list[torch.Tensor]:
    """[B, T, L, k] -> per layer [T*B, k] in Megatron's row order (t * B + b)."""
    B, T, L, k = experts_btlk.shape
    return [experts_btlk[:, :, layer, :].transpose(0, 1).reshape(T * B, k).long() for layer in range(L)]


@contextlib.contextmanager
def record_routing(model):
    """Record the experts each MoE layer routes to (model built with routing_replay=True)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = _replays(model)
    for r in replays:
        r.clear_indices()
        r.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield RoutingRecord(replays)
    finally:
        for r in replays:
            r.clear_router_replay_action()


@contextlib.contextmanager
def replay_routing(model, experts_btlk: torch.Tensor):
    """Forward passes inside route every token to the given experts: [B, T, L_stage, k] (see module doc).

    Each forward pass inside must be over the same [B, T] batch.  Raises ValueError naming a wrong
    shape or an expert index outside the model's experts.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = _replays(model)
    routers = moe_routers(model)
    num_experts, top_k = routers[0].config.num_moe_experts, routers[0].config.moe_router_topk
    if experts_btlk.dim() != 4 or experts_btlk.shape[2] != len(replays) or experts_btlk.shape[3] != top_k:
        raise ValueError(f"replayed experts must be [B, T, {len(replays)} layers, top_k {top_k}], "
                         f"got {tuple(experts_btlk.shape)}")
    if experts_btlk.numel() and (int(experts_btlk.min()) < 0 or int(experts_btlk.max()) >= num_experts):
        raise ValueError(f"replayed expert indices must lie in [0, {num_experts}), got "
                         f"[{int(experts_btlk.min())}, {int(experts_btlk.max())}]")
    device = routers[0].weight.device
    for r, rows in zip(replays, btlk_to_rows(experts_btlk)):
        r.clear_indices()
        r.set_target_indices(rows.to(device))
        r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for r in replays:
            r.clear_router_replay_action()
            r.clear_indices()


def routing_mismatch(a_btlk: torch.Tensor, b_btlk: torch.Tensor, mask_bt: torch.Tensor | None = None) -> dict:
    """How often two routings of the same tokens differ (the order of a token's k experts is ignored).

    Returns {"token_share": tokens whose expert set differs in at least one layer / tokens,
    "layer_token_share": (token, layer) pairs that differ / pairs, "tokens": tokens compared}.
    mask_bt (bool [B, T]) selects the tokens to compare (e.g. the response tokens).
    """
    if a_btlk.shape != b_btlk.shape:
        raise ValueError(f"routings have different shapes {tuple(a_btlk.shape)} and {tuple(b_btlk.shape)}")
    differs_btl = (a_btlk.sort(dim=-1).values != b_btlk.sort(dim=-1).values).any(dim=-1)  # [B, T, L]
    if mask_bt is None:
        mask_bt = torch.ones(differs_btl.shape[:2], dtype=torch.bool)
    mask_bt = mask_bt.bool()
    tokens = int(mask_bt.sum())
    if tokens == 0:
        return {"token_share": 0.0, "layer_token_share": 0.0, "tokens": 0}
    token_share = differs_btl.any(dim=-1)[mask_bt].float().mean().item()
    layer_share = differs_btl[mask_bt].float().mean().item()
    return {"token_share": token_share, "layer_token_share": layer_share, "tokens": tokens}


def encode_routing(experts_tlk) -> dict:
    """A sequence's routing [T, L, k] as a compact JSON-able record (uint8 when experts < 256)."""
    arr = np.asarray(experts_tlk)
    if arr.ndim != 3:
        raise ValueError(f"routing must be [T, L, k], got shape {arr.shape}")
    if arr.size and arr.min() < 0:
        raise ValueError("expert indices must be non-negative")
    dtype = np.uint8 if (arr.size == 0 or arr.max() < 256) else np.uint16
    return {"shape": list(arr.shape), "dtype": np.dtype(dtype).name, "data": arr.astype(dtype).tobytes().hex()}


def decode_routing(record: dict) -> np.ndarray:
    """Inverse of encode_routing: [T, L, k] int64; ValueError naming a malformed field."""
    for key in ("shape", "dtype", "data"):
        if key not in record:
            raise ValueError(f"routing record lacks field {key!r}")
    if record["dtype"] not in ("uint8", "uint16"):
        raise ValueError(f"routing record dtype {record['dtype']!r} is not uint8 or uint16")
    flat = np.frombuffer(bytes.fromhex(record["data"]), dtype=record["dtype"])
    shape = tuple(int(x) for x in record["shape"])
    if flat.size != int(np.prod(shape)):
        raise ValueError(f"routing record holds {flat.size} indices, its shape {shape} needs {int(np.prod(shape))}")
    return flat.reshape(shape).astype(np.int64)
