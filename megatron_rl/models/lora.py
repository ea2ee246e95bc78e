"""LoRA (Hu et al. 2021, eq. 3: h = W0 x + (alpha / r) B A x) on the GPT model's linear layers (the
`learner.lora:` section of the run config that asks for it: models/lora_config.py).

    lora = LoraConfig(enabled=True, rank=8, alpha=16, target_modules=["qkv", "proj"])
    learner = Learner(LearnerConfig(lora=lora, ...), hf_cfg)      # adapters on its model, only they train
    model = build_gpt_model(hf_cfg, platform=p, tp=2, pp=1, lora=lora)   # calls attach_adapters
    adapter_parameters(model)      # {name: param}: the only parameters with requires_grad

Legend: s sequence, b batch, r = lora.rank; in / out are a layer's full (TP1) sizes, tp the tensor
parallel size, k a TP rank.

Where the adapters sit.  Each targeted ColumnParallelLinear / RowParallelLinear of each transformer
layer gets a child module `adapter` (lora_a [r, in_k], lora_b [out_k, r]) and a forward hook that adds
scaling * B A x to the layer's output.  The base layer and its parameter names are untouched, so the
HF mapping, resharding and publication still see the base as before (conversion/model_io.py skips the
adapter tensors), and every base parameter is frozen (requires_grad False): Megatron's DDP gives
frozen parameters no grad buffer and its optimizer no state.

Tensor parallelism.  Each adapter tensor is split like the weight it sits beside
(models/tp_layout.py holds the layout by name):
  column parallel (qkv, fc1): rank k holds W_k, the rows of W for its slice y_k of the output, and
    the input x whole.  B is split the same way (rows of B follow the rows of W: whole KV groups for
    qkv, [gate_k; up_k] for fc1) and A is replicated: y_k += s B_k (A x).  h = A x [s, b, r] is the
    same on every rank, but its gradient sum_k B_k^T dy_k has a part on each rank: h passes through
    copy_to_tensor_model_parallel_region (identity forward, all-reduce of [s, b, r] backward), so dA
    and A's share of dx are whole, and equal, on every rank.
  row parallel (proj, fc2): rank k holds W_k, the columns of W for its input shard x_k, and the
    layer all-reduces the partial products W_k x_k.  A is split the same way (columns A_k) and B is
    replicated: B A x = B sum_k A_k x_k.  The partial products h_k = A_k x_k [s, b, r] are summed by
    reduce_from_tensor_model_parallel_region (all-reduce forward, identity backward): r numbers per
    token rather than out, and without rewriting the layer's forward to add sum_k B A_k x_k into its
    own reduction (the same sum).  B h is then the same on every rank and is added to y; dB = dy h^T
    is whole on every rank and dA_k = (B^T dy) x_k^T is rank k's columns of dA.
  The split tensors (B of column layers, A of row layers) carry Megatron's tensor_model_parallel
  attributes, so the gradient norm counts them on every rank and the replicated ones once.
Initialisation: B = 0, so step 0 is the base model; A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform
with a = sqrt(5), as nn.Linear and PEFT), drawn whole from a generator seeded by (lora.seed, global
layer, module) and then split: every TP layout starts from the same adapters.

The rest of LoRA lives beside its users:
  publication  adapters only, gathered over TP and renamed to PEFT's names (publish/adapter_source.py); the
               engines serve each version as a vLLM adapter on the base (publish/vllm_adapters.py).
  checkpoints  the adapters, their optimizer state and the base's digest (models/lora_checkpoint.py);
               export as a PEFT adapter or merged into the base (conversion/lora_export.py, lora_io.py).
  reference    the policy's own model under adapters_off below (no second copy of the weights).
  planner      gradients and optimizer state of the adapters only (planner/ledger.py).
  refused      model_problem below: MoE experts, sequence parallelism, Transformer Engine's fused norm +
               qkv/fc1 (it hides the normed input an adapter needs).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from megatron_rl.models.lora_config import TARGET_MODULES, VLLM_LORA_RANKS, LoraConfig  # noqa: F401 (re-exported)
from megatron_rl.models.tp_layout import tp_shard

_SITES = {"qkv": ("self_attention", "linear_qkv", "column"), "proj": ("self_attention", "linear_proj", "row"),
          "fc1": ("mlp", "linear_fc1", "column"), "fc2": ("mlp", "linear_fc2", "row")}
"""target -> (the layer's submodule, the linear's attribute in it, how Megatron splits it)."""


def model_problem(lora: LoraConfig, hf_cfg, config, platform) -> str | None:
    """Why adapters cannot go on this model (HFModelConfig, TransformerConfig, Platform), or None."""
    if hf_cfg.moe is not None and {"fc1", "fc2"} & set(lora.target_modules):
        return (f"learner.lora.target_modules {lora.target_modules} on a MoE model ({hf_cfg.arch}): fc1/fc2 are its "
                f"experts' layers, which take no adapters yet; target qkv and proj only")
    if config.sequence_parallel:
        return ("learner.lora.enabled with sequence parallelism (a MoE model at learner.tensor_parallel_size > 1): "
                "the adapters do not split the sequence yet; use learner.tensor_parallel_size 1")
    if platform.use_te:
        return ("learner.lora.enabled on the Transformer Engine platform: TE fuses the norm into qkv and fc1, hiding the "
                "input an adapter needs; adapters run on the local layer spec only for now")
    return None


class LoraAdapter(torch.nn.Module):
    """scaling * B A x beside one Megatron linear layer (this rank's share; see the module docstring)."""

    def __init__(self, lora_a: torch.Tensor, lora_b: torch.Tensor, *, parallel: str, scaling: float,
                 dropout: float, tp_group):
        super().__init__()
        assert parallel in ("column", "row"), parallel
        self.lora_a = torch.nn.Parameter(lora_a)  # [r, in_k] (row) or [r, in] (column)
        self.lora_b = torch.nn.Parameter(lora_b)  # [out_k, r] (column) or [out, r] (row)
        self.parallel, self.scaling, self.dropout, self.tp_group = parallel, scaling, dropout, tp_group
        self.active = True  # False inside adapters_off: the layer computes its base alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        if self.dropout and self.training:
            if self.parallel == "row":  # x_k differs per rank: the model-parallel RNG (per-rank masks)
                with get_cuda_rng_tracker().fork():
                    x = F.dropout(x, self.dropout)
            else:  # x is the same on every rank: the default RNG, seeded alike on every TP rank
                x = F.dropout(x, self.dropout)
        h = F.linear(x, self.lora_a)  # [s, b, r]
        if self.parallel == "column":
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return F.linear(h, self.lora_b) * self.scaling  # [s, b, out_k] (column) or [s, b, out] (row)


def _add_adapter_output(linear, args, output):
    """Forward hook of an adapted linear layer: its (output, bias) with the adapter's term added
    (unless `adapters_off` holds the adapters back: the base layer's output as it is)."""
    if not linear.adapter.active:
        return output
    out, bias = output
    return out + linear.adapter(args[0]), bias


@contextlib.contextmanager
def adapters_off(*models):
    """Within the block, `models` (model chunks, any wrapper) compute their base: every adapter's term is
    left out.  The reference of a LoRA run is its own policy model under this: no second copy of the weights."""
    adapters = [m for model in models for m in model.modules() if isinstance(m, LoraAdapter)]
    for adapter in adapters:
        adapter.active = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.active = True


def adapt(model, lora: LoraConfig | None, hf_cfg, config, platform, *, tp: int, tp_rank: int) -> int:
    """What models/builder.py does with a built stage: with `lora` enabled, check the model takes adapters
    (model_problem: ValueError) and attach them (attach_adapters); else leave every parameter as it is.
    Returns how many adapters were attached."""
    if lora is None or not lora.enabled:
        return 0
    problem = model_problem(lora, hf_cfg, config, platform)
    if problem:
        raise ValueError(problem)
    return attach_adapters(model, lora, tp=tp, tp_rank=tp_rank)


def attach_adapters(model, lora: LoraConfig, *, tp: int, tp_rank: int) -> int:
    """Freeze every parameter of `model` (a GPTModel stage) and put an adapter beside each targeted linear
    layer of its transformer layers; returns how many.  Call before DDP wraps the model."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    model.requires_grad_(False)
    count = 0
    for layer in model.decoder.layers:
        for target in lora.target_modules:
            part, attr, parallel = _SITES[target]
            linear = getattr(getattr(layer, part), attr)
            weight = linear.weight  # [out_k, in] (column) or [out, in_k] (row)
            fan_in = weight.shape[1] * (tp if parallel == "row" else 1)
            gen = torch.Generator().manual_seed(_adapter_seed(lora.seed, layer.layer_number, target))
            bound = 1.0 / math.sqrt(fan_in)
            full_a = torch.empty(lora.rank, fan_in).uniform_(-bound, bound, generator=gen)  # [r, in]
            lora_a = tp_shard(f"{attr}.adapter.lora_a", full_a, tp, tp_rank)
            lora_b = torch.zeros(weight.shape[0], lora.rank)
            adapter = LoraAdapter(lora_a.to(weight.dtype).to(weight.device).contiguous(),
                                  lora_b.to(weight.dtype).to(weight.device), parallel=parallel,
                                  scaling=lora.scaling, dropout=lora.dropout, tp_group=getattr(linear, "tp_group", None))
            split = adapter.lora_b if parallel == "column" else adapter.lora_a
            set_tensor_model_parallel_attributes(split, True, 0 if parallel == "column" else 1, 1)
            linear.adapter = adapter
            linear.register_forward_hook(_add_adapter_output)
            count += 1
    return count


def _adapter_seed(seed: int, layer_number: int, target: str) -> int:
    """One generator seed per (lora.seed, global layer number, target module)."""
    return (seed * 1_000_003 + layer_number * len(TARGET_MODULES) + list(TARGET_MODULES).index(target)) % 2**63


def canonical_adapters(model) -> dict[str, torch.nn.Parameter]:
    """This stage's adapter parameters under canonical names, with the global layer index:
    `decoder.layers.{i}.self_attention.linear_qkv.adapter.lora_a`, ... (conversion/lora_export.py's input)."""
    while hasattr(model, "module"):
        model = model.module
    out = {}
    for local, layer in enumerate(model.decoder.layers):
        prefix = f"decoder.layers.{local}."
        for name, param in layer.named_parameters(prefix=prefix.rstrip(".")):
            if ".adapter.lora_" in name:
                out[f"decoder.layers.{layer.layer_number - 1}.{name[len(prefix):]}"] = param
    return out


def base_parameters(model):
    """(name, parameter) of `model` (any wrapper) but its adapters: the base layers' own."""
    return ((name, p) for name, p in model.named_parameters() if ".adapter.lora_" not in name)


def adapter_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The adapter parameters of `model` (any wrapper) by name: what the optimizer trains."""
    return {name: p for name, p in model.named_parameters() if ".adapter.lora_" in name}


def adapter_snapshot(chunks) -> list[dict[str, torch.Tensor]] | None:
    """A copy of every adapter parameter of `chunks` (a learner's model chunks) before an optimizer step; None
    for a model without adapters (full-parameter training)."""
    snapshot = [{n: p.detach().clone() for n, p in adapter_parameters(chunk).items()} for chunk in chunks]
    return snapshot if any(snapshot) else None


@torch.no_grad()
def adapter_metrics(chunks, before: list[dict[str, torch.Tensor]] | None) -> dict[str, float]:
    """adapter_norm ||theta|| of the whole model's adapters and adapter_update_ratio ||theta - before|| / ||before||
    of the step since `before` (adapter_snapshot): TP shards and pipeline stages summed, a replicated tensor
    counted once (on TP rank 0).  Collective over the model-parallel group.  {} without adapters (None)."""
    if before is None:
        return {}
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    first_tp = ps.get_tensor_model_parallel_rank() == 0
    sums = torch.zeros(3, dtype=torch.float64)  # ||theta||^2, ||delta||^2, ||before||^2
    for chunk, old in zip(chunks, before):
        for name, p in adapter_parameters(chunk).items():
            if getattr(p, "tensor_model_parallel", False) or first_tp:
                new, prev = p.detach().double().cpu(), old[name].double().cpu()
                sums += torch.stack([new.square().sum(), (new - prev).square().sum(), prev.square().sum()])
    if ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() > 1:
        device = next(iter(chunks[0].parameters())).device
        sums = sums.to(device)
        dist.all_reduce(sums, group=ps.get_model_parallel_group())
    norm, delta, prev = sums.sqrt().tolist()
    return {"adapter_norm": norm, "adapter_update_ratio": delta / prev if prev > 0 else float("nan")}
