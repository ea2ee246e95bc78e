"""The Megatron learner: model chunks, DDP, optimizer, LR schedule, one train step at a time.

    init_distributed(platform)                       # once per process
    learner = Learner(LearnerConfig(...), hf_cfg)    # builds parallel state if not up yet
    # LearnerConfig(lora=LoraConfig(enabled=True)): LoRA adapters on a frozen base (models/lora.py)
    metrics = learner.train_step(batch, loss_fn)     # {"loss", "grad_norm", "lr", ...}
    logprobs_bt = learner.forward_logprobs(tokens_bt)
    learner.close()

Batches are GLOBAL: every rank passes the same `batch` dict whose tensors have leading dim
global_batch_size (B); the learner takes its data-parallel rows and splits them into
micro-batches (megatron_rl.learner.micro_batches): fixed ones of micro_batch_size rows as wide
as the batch, or, with learner.max_tokens_per_micro_batch, rows sorted by length and packed
within a token budget, each micro-batch as wide as its own longest row (`batch["lengths"]` [B],
the real tokens per row; without it every row counts as T long).  `batch["tokens"]` is [B, T]
(long); any other tensor with leading dim B (advantages [B], loss_mask [B, T-1], old_logprobs
[B, T-1], ...) is sliced the same way, its dim 1 cut to the micro-batch's width when it is T or
T-1, and handed to the loss with `num_micro_batches` = K, the micro-batches of the whole step
over all data-parallel ranks.  `padding_fraction` (padded / computed token positions) comes
back with the step's metrics.  A MoE model at TP > 1 runs sequence parallel (Megatron trains MoE
at TP > 1 only so): each micro-batch is padded at its end to a multiple of TP for the forward pass
and its logits cut back to the real width (causal attention keeps the padding out of them).

The loss interface (GRPO and friends plug in here):

    def loss_fn(logprobs_bt: Tensor, micro_batch: dict) -> tuple[Tensor, dict[str, Tensor | float]]
        # logprobs_bt [b, T-1]: log p(tokens[:, t+1] | tokens[:, :t+1]) under the current
        # policy, differentiable, already reduced over TP.  Return the micro-batch's scalar
        # loss (the learner averages micro-batches, DDP averages data-parallel ranks: give each
        # micro-batch the global normaliser / mb["num_micro_batches"] for an exact batch mean)
        # and statistics, tensors on the loss's device: 0-dim ones are additive (summed over
        # micro-batches and data-parallel ranks), [b] ones are per sequence (placed at their rows
        # of the global batch, [B]).  One all-reduce per step, one host sync.

    def step_fn(stats: dict[str, float | list[float]]) -> tuple[float, dict[str, float]]
        # optional, train_step(batch, loss_fn, step_fn): sees the batch-wide statistics after
        # the backward and before the optimizer step; returns the gradient weight (1: step as
        # usual; 0: skip the step; otherwise the gradients are scaled by it) and the metrics.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from megatron_rl.learner.config import LearnerConfig, SamplingConfig, batch_problem, uses_sequence_parallel
from megatron_rl.learner.logprobs import token_logprobs
from megatron_rl.learner.micro_batches import MicroBatchPlan, plan_micro_batches
from megatron_rl.learner.optimizer import build_optimizer, build_scheduler, load_optimizer_state
from megatron_rl.learner.optimizer_state import materialize_optimizer_state, unshare_adam_steps
from megatron_rl.learner.step_stats import adapter_metrics, adapter_snapshot, micro_batch_stats, reduce_step_stats
from megatron_rl.models.builder import build_gpt_model, build_transformer_config
from megatron_rl.models.hf_config import HFModelConfig, check_parallel_layout
from megatron_rl.platform import Platform, detect_platform
from megatron_rl.platform.parallel import destroy_parallel, initialize_parallel

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, dict], tuple]
StepFn = Callable[[dict], tuple]


class Learner:
    """One rank's share of a Megatron-Core policy and its optimizer."""

    def __init__(self, cfg: LearnerConfig, hf_cfg: HFModelConfig, platform: Platform | None = None,
                 sampling: SamplingConfig | None = None):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads

        self.cfg, self.hf_cfg = cfg, hf_cfg
        self.sampling = sampling or SamplingConfig()  # the distribution every logprob here is taken under
        self.platform = platform or detect_platform(dtype=cfg.dtype)
        tp, pp, ep = cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.expert_parallel_size
        self.dp = _data_parallel_size(cfg, hf_cfg)
        self.sequence_parallel = uses_sequence_parallel(hf_cfg.moe is not None, tp)
        self._owns_parallel = not ps.model_parallel_is_initialized()
        if self._owns_parallel:
            initialize_parallel(tp=tp, pp=pp, seed=cfg.seed, ep=ep)
        elif (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (tp, pp):
            raise ValueError(f"parallel state is already up with a different layout than tp={tp}, pp={pp}")

        overrides = {"sequence_parallel": True} if self.sequence_parallel else {}
        if cfg.recompute_activations:
            overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        self.config = build_transformer_config(hf_cfg, tp=tp, pp=pp, platform=self.platform, ep=ep,
                                               routing_replay=cfg.moe_routing_replay, **overrides)
        # With learner.lora the base is frozen: DDP gives only the adapters grad buffers, the optimizer only
        # their state (models/lora.py).
        module = build_gpt_model(hf_cfg, platform=self.platform, tp=tp, pp=pp, config=self.config, lora=cfg.lora)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        )
        self.model = [DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=module)]
        self.optimizer = build_optimizer(cfg, self.model, dtype=self.platform.dtype)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        # What Megatron's schedules read from the model config during forward_backward.
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.no_sync_func = self.model[0].no_sync
        self.step = 0

    # ---- batches ---------------------------------------------------------------------------

    def fits_micro_batch(self, micro_batch_size: int) -> bool:
        """The global batch splits into micro-batches of this size on every data-parallel rank."""
        return micro_batch_size >= 1 and batch_problem(self.cfg.global_batch_size, micro_batch_size, self.dp) is None

    def _plan(self, batch: dict, micro_batch_size: int | None = None) -> MicroBatchPlan:
        """This step's micro-batches (the same plan on every rank, see learner.micro_batches); `micro_batch_size`
        replaces the configured one (a forward of fewer rows than a step's)."""
        tokens = batch.get("tokens")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise ValueError("batch['tokens'] must be a [B, T] tensor of token ids")
        b, t = tokens.shape
        if t < 2:
            raise ValueError(f"sequences need at least 2 tokens, got T={t}")
        lengths = batch.get("lengths")
        if lengths is None:
            lengths = [t] * b
        else:
            lengths = torch.as_tensor(lengths).reshape(-1).clamp(min=2, max=t).tolist()
            if len(lengths) != b:
                raise ValueError(f"batch['lengths'] has {len(lengths)} entries for {b} sequences")
            mask = batch.get("loss_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                # The loss must not reach past a row's length (those positions are never computed).
                cols = torch.arange(mask.shape[1])
                beyond = (mask.detach().cpu() != 0) & (cols[None, :] >= torch.tensor(lengths)[:, None] - 1)
                if bool(beyond.any()):
                    raise ValueError("batch['loss_mask'] covers positions at or beyond batch['lengths']")
        return plan_micro_batches(lengths, dp=self.dp, micro_batch_size=micro_batch_size or self.cfg.micro_batch_size,
                                  max_tokens=self.cfg.max_tokens_per_micro_batch, width=t)

    def _local_micro_batches(self, batch: dict, plan: MicroBatchPlan) -> list[dict]:
        """This rank's micro-batches: its rows of every [B, ...] tensor, [B, T] / [B, T-1] ones cut
        to the micro-batch's width, plus `num_micro_batches` (K of the whole step, for normalisers)."""
        from megatron.core import parallel_state as ps

        b, t = batch["tokens"].shape
        device = self.platform.device
        k = plan.num_micro_batches
        micro = []
        for rows, width in plan.ranks[ps.get_data_parallel_rank()]:
            index = torch.tensor(rows, dtype=torch.long)
            mb = {}
            for key, v in batch.items():
                if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == b:
                    v = v.index_select(0, index.to(v.device))
                    if v.dim() >= 2 and v.shape[1] == t:
                        v = v[:, :width]
                    elif v.dim() >= 2 and v.shape[1] == t - 1:
                        v = v[:, :width - 1]
                    v = v.to(device)
                mb[key] = v
            mb["num_micro_batches"] = k
            micro.append(mb)
        return micro

    def _padded_width(self, width: int) -> int:
        """Sequence parallelism splits the sequence over TP ranks: widths round up to a multiple of TP."""
        tp = self.cfg.tensor_parallel_size if self.sequence_parallel else 1
        return -(-width // tp) * tp

    def _forward_step(self, loss_fn: LossFn | None, sampling: SamplingConfig | None, data_iterator, model):
        from megatron.core import parallel_state as ps

        mb = next(data_iterator)
        tokens = mb["tokens"]  # [b, T]
        width = tokens.shape[1]
        padded = self._padded_width(width)
        if padded != width:  # pad tokens at the end: causal attention keeps them out of positions < T
            tokens = torch.nn.functional.pad(tokens, (0, padded - width))
        position_ids = torch.arange(padded, device=tokens.device).unsqueeze(0).expand_as(tokens)
        output = model(tokens, position_ids, attention_mask=None)  # last stage: [b, T', V/tp]; else hidden
        if padded != width and ps.is_pipeline_last_stage():
            output = output[:, :width]  # logits of the real positions (the SP gather ran before the output layer)
        return output, partial(self._loss_on_logits, loss_fn, mb, sampling=sampling)

    def _loss_on_logits(self, loss_fn: LossFn | None, mb: dict, logits_btv: torch.Tensor, non_loss_data=False, *,
                        sampling: SamplingConfig | None = None):
        sampling = sampling or self.sampling  # the policy's (the engine's) distribution unless told otherwise
        logprobs_bt = token_logprobs(logits_btv, mb["tokens"], self.hf_cfg.vocab_size, sampling)  # [b, T-1]
        if non_loss_data:
            return logprobs_bt.detach()
        loss, metrics = loss_fn(logprobs_bt, mb)
        # Every statistic on the loss's device (Python floats included), as the loss interface says;
        # reduce_step_stats concatenates them into one tensor for one all-reduce (NCCL: on the GPU).
        return loss, micro_batch_stats(loss, metrics)

    def _run(self, micro: list[dict], loss_fn: LossFn | None, forward_only: bool, model: list | None = None,
             sampling: SamplingConfig | None = None):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # Pipeline stages receive activations of the shape they are told; with micro-batches of
        # different shapes (token budget) the stages exchange each one's shape first.
        self.config.variable_seq_lengths = bool(self.cfg.max_tokens_per_micro_batch)
        return get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, loss_fn, sampling),
            data_iterator=iter(micro),
            model=model or self.model,
            num_microbatches=len(micro),
            seq_length=self._padded_width(max(mb["tokens"].shape[1] for mb in micro)),
            micro_batch_size=max(mb["tokens"].shape[0] for mb in micro),
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )

    # ---- public API ----------------------------------------------------------------------------

    def forward_backward(self, batch: dict, loss_fn: LossFn) -> dict:
        """Gradients of the global `batch` in the DDP grad buffers (`param.main_grad`, reduced over
        data-parallel ranks), no optimizer step; returns the batch-wide statistics (see
        learner.step_stats)."""
        from megatron.core import parallel_state as ps

        if batch["tokens"].shape[0] != self.cfg.global_batch_size:
            raise ValueError(f"batch has {batch['tokens'].shape[0]} sequences, "
                             f"learner.global_batch_size is {self.cfg.global_batch_size}")
        plan = self._plan(batch)
        micro = self._local_micro_batches(batch, plan)
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(micro, loss_fn, forward_only=False)
        stats = reduce_step_stats(outputs if ps.is_pipeline_last_stage() else None,
                                  batch_size=batch["tokens"].shape[0], plan=plan, device=self.platform.device)
        stats["padding_fraction"] = plan.padding_fraction
        return stats

    def train_step(self, batch: dict, loss_fn: LossFn, step_fn: StepFn | None = None) -> dict[str, float]:
        """One optimizer step on the global `batch`; returns metrics, loss, grad_norm, lr.

        With `step_fn`, its gradient weight w decides the step (the same on every rank):
        w = 1 steps as usual; w = 0 skips it: no optimizer step (weights and optimizer state
        untouched) and the LR schedule does not advance, as for any step that applies no update
        (Megatron's skipped iteration); other w scale the reduced gradients before clipping and
        the step, which equals scaling the batch loss.  `self.step` counts train_step calls
        (batches consumed) either way; `update_successful` says whether weights moved and
        `grad_norm` is that of the gradient handed to the optimizer (0 when skipped).
        """
        from megatron.core import parallel_state as ps

        stats = self.forward_backward(batch, loss_fn)
        weight, metrics = step_fn(stats) if step_fn is not None else (1.0, dict(stats))
        metrics["loss"] = stats["loss"]
        metrics["padding_fraction"] = stats["padding_fraction"]
        if ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() > 1:
            # one decision for all TP/PP ranks of a replica (DP ranks hold the same reduced stats)
            w = torch.tensor([float(weight)], dtype=torch.float64, device=self.platform.device)
            dist.all_reduce(w, op=dist.ReduceOp.MIN, group=ps.get_model_parallel_group())
            weight = float(w.item())
        ok, grad_norm = False, 0.0
        before = adapter_snapshot(self.model)  # LoRA: the adapters, to report the step's update (else None)
        if weight > 0.0:
            if weight != 1.0:
                for chunk in self.model:
                    chunk.scale_gradients(weight)
            ok, grad_norm, _ = self.optimizer.step()
            if ok:
                self.scheduler.step(increment=self.cfg.global_batch_size)
        self.step += 1
        metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                       lr=self.optimizer.param_groups[0]["lr"], update_successful=float(bool(ok)))
        metrics.update(adapter_metrics(self.model, before))
        return metrics

    @torch.no_grad()
    def forward_logprobs(self, tokens_bt: torch.Tensor, lengths_b: torch.Tensor | None = None,
                         model: list | None = None, sampling: SamplingConfig | None = None,
                         raw: bool = False) -> torch.Tensor:
        """log p(tokens[:, t+1] | tokens[:, :t+1]) under `sampling` (default `self.sampling`), global
        [B, T] -> [B, T-1] on every rank, in the rows' order; of the policy, or of `model` (chunks in the
        policy's layout: the frozen reference, ranks/build.py, scored untruncated).  With
        `lengths_b` [B] (real tokens per row), positions at or beyond a row's length - 1 (predictions
        of padding) hold 0; a token budget never computes them.  `raw`: the model's own distribution
        (temperature 1, no truncation: what an engine's teacher-forced prompt logprobs are, for the
        refit check)."""
        if raw:
            sampling = SamplingConfig()
        from megatron.core import parallel_state as ps

        batch = {"tokens": tokens_bt} if lengths_b is None else {"tokens": tokens_bt, "lengths": lengths_b}
        b = tokens_bt.shape[0]
        few = b < self.cfg.micro_batch_size * self.dp and b % self.dp == 0  # e.g. an audit of a few sequences
        plan = self._plan(batch, micro_batch_size=b // self.dp if few else None)
        micro = self._local_micro_batches(batch, plan)
        for chunk in model or self.model:
            chunk.eval()
        outputs = self._run(micro, None, forward_only=True, model=model, sampling=sampling)
        b, t = tokens_bt.shape
        # Each row is filled on exactly one data-parallel rank: a sum over DP puts every row in place.
        full = torch.zeros(b, t - 1, dtype=torch.float32, device=self.platform.device)
        if ps.is_pipeline_last_stage():
            for (rows, width), out in zip(plan.ranks[ps.get_data_parallel_rank()], outputs):
                full[torch.tensor(rows, dtype=torch.long, device=full.device), :width - 1] = out.float()
            if lengths_b is not None:
                real = torch.as_tensor(lengths_b, device=full.device).reshape(-1, 1) - 1
                full.masked_fill_(torch.arange(t - 1, device=full.device)[None, :] >= real, 0.0)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(full, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        if self.dp > 1:
            dist.all_reduce(full, group=ps.get_data_parallel_group())
        return full.cpu()  # [B, T-1]

    def state_dict(self) -> dict:
        """This rank's model shard, optimizer and scheduler state (plain torch.save-able)."""
        return {"model": self.model[0].module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "step": self.step}

    # The distributed optimizer's default format (flattened model-space ranges) is rejected by
    # dist_checkpointing 0.16; "fully_reshardable" stores canonical per-parameter state instead,
    # which also loads at another TP/PP/DP.  Its memory-efficient exchange gathers param, exp_avg
    # and exp_avg_sq over the gloo DP group into host memory of DP rank 0 only; without it each
    # of the three is all-gathered over NCCL into GPU buffers on every rank (with one DDP bucket,
    # a whole TP shard each: ~15 GB more at 7B TP2 on the first save).  Loading is unchanged.
    OPTIMIZER_CKPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                               "distrib_optim_fully_reshardable_mem_efficient": True}

    def sharded_state_dict(self, is_loading: bool = False, model_sd: dict | None = None) -> dict:
        """Megatron dist_checkpointing form (save at one layout, load at another).  `model_sd`: the model's
        entries to save, default all of them; with learner.lora, WeightIO passes the adapters' alone
        (models/lora_checkpoint.py), and the optimizer state that goes with them is theirs."""
        if model_sd is None:
            model_sd = self.model[0].module.sharded_state_dict()
        if is_loading:
            self._materialize_optimizer_state()
        if self.cfg.use_distributed_optimizer:
            optim_sd = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                         metadata=self.OPTIMIZER_CKPT_METADATA)
        else:
            optim_sd = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
        return {"model": model_sd, "optimizer": optim_sd,
                "scheduler": self.scheduler.state_dict(), "step": self.step}

    def _materialize_optimizer_state(self) -> None:
        """Optimizer state a checkpoint can be loaded into, per optimizer family (see
        megatron_rl.learner.optimizer_state: torch Adam gets zeros and step 0; TE/Apex FusedAdam,
        whose state_dict() rejects a per-parameter 'step', is left to Megatron-Core)."""
        materialize_optimizer_state(self.optimizer)

    def load_sharded_state_dict(self, state: dict) -> None:
        """Load what dist_checkpointing.load returned for `sharded_state_dict(is_loading=True)`."""
        self.model[0].module.load_state_dict(state["model"], strict=False)
        load_optimizer_state(self.optimizer, state["optimizer"])
        unshare_adam_steps(self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        self.model[0].module.load_state_dict(state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])

    def close(self) -> None:
        """Release the parallel state if this learner created it."""
        if self._owns_parallel:
            destroy_parallel()
            self._owns_parallel = False


def _data_parallel_size(cfg: LearnerConfig, hf_cfg: HFModelConfig) -> int:
    """The data-parallel size the world leaves for cfg's TP x PP, once the layout and batch fit it."""
    tp, pp, ep = cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.expert_parallel_size
    if not dist.is_initialized():
        raise RuntimeError("Learner needs torch.distributed: call platform.parallel.init_distributed first")
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tensor_parallel_size*"
                         f"pipeline_parallel_size = {tp}*{pp}")
    dp = world // (tp * pp)
    check_parallel_layout(hf_cfg, tp, pp, dp, ep=ep)
    if hf_cfg.moe is not None and tp > 1 and cfg.moe_routing_replay:
        raise ValueError("learner.moe_routing_replay with learner.tensor_parallel_size > 1: a MoE learner "
                         "at TP > 1 runs sequence parallel, which routing replay does not support; "
                         "use TP 1 (experts split by learner.expert_parallel_size) for routing replay")
    if cfg.global_batch_size is None:
        raise ValueError("learner.global_batch_size must be set (a training run derives it)")
    problem = batch_problem(cfg.global_batch_size, cfg.micro_batch_size, dp)
    if problem:
        raise ValueError(f"learner.global_batch_size {problem}")
    return dp
