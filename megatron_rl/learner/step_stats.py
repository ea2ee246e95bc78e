"""A train step's batch-wide statistics: what the loss reported per micro-batch, reduced.

    reported = micro_batch_stats(loss, stats)     # in the loss hook: detached float32 on the loss's device
    stats = reduce_step_stats(outputs, batch_size=B, plan=plan, device=device)   # the same on every rank

0-dim statistics are additive: summed over micro-batches and data-parallel ranks.  [b] ones are
per sequence: placed at their rows of the global batch ([B], zeros elsewhere) and summed the same
way, so they come back as lists of B floats.  `loss` is the mean of the micro-batch losses of the
batch (the objective the gradients are of).  One all-reduce over DP (every statistic concatenated
into one tensor, on the platform device: NCCL on a GPU) and one host sync per step; computed on
the last pipeline stage and broadcast to the others.

A LoRA learner's step also reports its adapters' norm and the step's relative update (models/lora.py
adapter_snapshot / adapter_metrics).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.learner.micro_batches import MicroBatchPlan
from megatron_rl.models.lora import adapter_metrics, adapter_snapshot  # noqa: F401 (a step's LoRA statistics)


def micro_batch_stats(loss: torch.Tensor, stats: dict) -> dict[str, torch.Tensor]:
    """The loss's statistics (tensors or Python floats) and `loss`, detached float32 on the loss's device."""
    reported = {k: (v.detach().float().clone() if isinstance(v, torch.Tensor)
                    else torch.tensor(float(v), dtype=torch.float32, device=loss.device))
                for k, v in stats.items()}
    reported["loss"] = loss.detach().float().clone()  # the schedule divides `loss` in place
    return reported


def reduce_step_stats(outputs: list[dict] | None, *, batch_size: int, plan: MicroBatchPlan,
                      device: torch.device) -> dict:
    """Batch-wide statistics on every rank from this rank's micro-batch `outputs` (None off the last stage)."""
    from megatron.core import parallel_state as ps

    payload = [None]
    if outputs is not None:
        payload = [_reduce_over_data_parallel(outputs, batch_size, plan, device)]
    if ps.get_pipeline_model_parallel_world_size() > 1:
        src = ps.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(payload, src=src, group=ps.get_pipeline_model_parallel_group())
    return payload[0]


def _reduce_over_data_parallel(outputs: list[dict], batch_size: int, plan: MicroBatchPlan,
                               device: torch.device) -> dict:
    from megatron.core import parallel_state as ps

    local = plan.ranks[ps.get_data_parallel_rank()]
    keys = sorted(outputs[0])
    parts = []
    for k in keys:
        values = [torch.as_tensor(o[k], dtype=torch.float64, device=device) for o in outputs]
        if values[0].dim() == 0:
            parts.append(torch.stack(values).sum().reshape(1))
            continue
        if any(v.shape != (len(rows),) for v, (rows, _) in zip(values, local)):
            raise ValueError(f"statistic {k!r} must be 0-dim or [rows of the micro-batch], "
                             f"got {tuple(values[0].shape)}")
        placed = torch.zeros(batch_size, dtype=torch.float64, device=device)
        index = torch.tensor([i for rows, _ in local for i in rows], dtype=torch.long, device=device)
        placed[index] = torch.cat(values)
        parts.append(placed)
    flat = torch.cat(parts)
    dist.all_reduce(flat, group=ps.get_data_parallel_group())
    chunks = flat.tolist()
    reduced, i = {}, 0
    for k, part in zip(keys, parts):
        n = part.numel()
        reduced[k] = chunks[i:i + n] if outputs[0][k].dim() else chunks[i]
        i += n
    reduced["loss"] = reduced["loss"] / plan.num_micro_batches
    return reduced
