"""Single-step reconciliation: is the learner scoring exactly what the rollout sampled?

    megatron-rl reconcile --config configs/tiny_cpu.yaml [--json]

At the current policy (step 0, or the newest checkpoint) it samples one round, grades it, and
for every sampled token puts side by side: the behavior logprob (vLLM), the current logprob
(Megatron learner, same weights), the reference logprob (the frozen initial policy), the loss
mask, and per sequence the reward, the advantage and the sign of the gradient of the loss
with respect to its logprobs.  At step 0 behavior and current must agree to ~1e-5 (fp32), at
any rollout.temperature/top_p/top_k (the learner scores the distribution the engine sampled,
`TrainConfig.sampling`, echoed in the summary): the summary reports their mean and max
absolute difference.  The gradient-sign check covers every sequence of the round (the table
shows the first `max_rows`), and `nonzero_variance_groups` says how many groups could carry a
sign at all (a round where every group is uniform checks nothing, and says so).
"""

from __future__ import annotations

import math

import torch


def reconcile(cfg, max_rows: int = 8) -> dict:
    from megatron_rl.grpo.loss import grpo_loss
    from megatron_rl.train.batch import build_batch
    from megatron_rl.train.resume import choose_resume
    from megatron_rl.train.roles import Roles

    roles = Roles.build(cfg, resume_from=choose_resume(cfg))
    try:
        state, _ = roles.checkpointer.resume(roles.policy, roles.source, roles.coordinator)
        samples, _ = roles.source.sample_round(state.step)
        trajs, _ = roles.scorer.score(samples)
        batch, _ = build_batch(trajs, pad_id=roles.inputs.pad_id, loss_cfg=cfg.loss,
                               micro_batch_size=cfg.learner.micro_batch_size)
        current = roles.policy.learner.forward_logprobs(batch["tokens"])  # [B, T-1]
        reference = roles.policy.learner.reference_logprobs(batch["tokens"])  # [B, T-1]
        lp = current.clone().requires_grad_(True)
        loss, _ = grpo_loss(lp, batch["behavior_logprobs"], reference, batch["advantages"], batch["loss_mask"],
                            cfg.loss.at_step(state.step))  # the whole batch in one call: its own counts
        loss.backward()
        mask = batch["loss_mask"].bool()
        diff = (current - batch["behavior_logprobs"]).abs()[mask]
        rows = []
        for i, tr in enumerate(trajs[:max_rows]):
            pos = mask[i].nonzero().flatten().tolist()
            rows.append({
                "id": tr.id, "reward": tr.reward, "status": tr.status, "advantage": float(batch["advantages"][i]),
                "tokens": [int(batch["tokens"][i, p + 1]) for p in pos],
                "behavior": [float(batch["behavior_logprobs"][i, p]) for p in pos],
                "current": [float(current[i, p]) for p in pos],
                "reference": [float(reference[i, p]) for p in pos],
                "mask": [1] * len(pos),
                "grad_sign": [int(torch.sign(lp.grad[i, p])) for p in pos],
            })
        signs = grad_sign_check(lp.grad, mask, batch["advantages"], [t.in_loss for t in trajs])
        summary = {
            "step": state.step, "policy_version": state.version, "sequences": len(trajs),
            "sampling": cfg.sampling.as_dict(),
            "tokens": int(mask.sum()), "behavior_vs_current_mean_abs": float(diff.mean()) if diff.numel() else 0.0,
            "behavior_vs_current_max_abs": float(diff.max()) if diff.numel() else 0.0,
            "loss": float(loss),
            "grad_sign_agrees_with_advantage": signs["agrees"],
            "grad_sign_checked_sequences": signs["checked_sequences"],
            "grad_sign_disagreeing_rows": signs["disagreeing_rows"],
            "nonzero_variance_groups": nonzero_variance_groups(trajs),
        }
        return {"summary": summary, "rows": rows}
    finally:
        roles.close()


def grad_sign_check(grad_bt: torch.Tensor, mask_bt: torch.Tensor, advantages_b: torch.Tensor,
                    in_loss: list[bool]) -> dict:
    """Over EVERY sequence of the round: a positive advantage must push each of its tokens' logprobs
    up (dL/dlogp < 0), a negative one down.  Sequences with advantage 0 or not in the loss carry
    no sign to check; `agrees` is False when no sequence was checked (nothing was shown).

    grad_bt [B, T-1] dL/dlogp, mask_bt [B, T-1] loss mask, advantages_b [B]."""
    bad, checked = [], 0
    for i in range(grad_bt.shape[0]):
        adv = float(advantages_b[i])
        if adv == 0 or not in_loss[i]:
            continue
        checked += 1
        signs = torch.sign(grad_bt[i][mask_bt[i].bool()])
        if signs.numel() == 0 or not bool((signs == -math.copysign(1.0, adv)).all()):
            bad.append(i)
    return {"agrees": checked > 0 and not bad, "checked_sequences": checked, "disagreeing_rows": bad}


def nonzero_variance_groups(trajs: list) -> int:
    """GRPO groups (same prompt) whose rewards in the loss differ: only they produce a gradient."""
    groups: dict[str, set] = {}
    for t in trajs:
        if t.in_loss:
            groups.setdefault(t.prompt_id, set()).add(t.reward)
    return sum(len(rewards) > 1 for rewards in groups.values())


def render_table(report: dict) -> str:
    lines = [f"{'seq':<28}{'tok':>5}{'behavior':>11}{'current':>11}{'reference':>11}{'mask':>5}"
             f"{'reward':>8}{'adv':>8}{'grad':>5}"]
    for r in report["rows"]:
        for j, tok in enumerate(r["tokens"]):
            lines.append(f"{r['id'][-28:]:<28}{tok:>5}{r['behavior'][j]:>11.5f}{r['current'][j]:>11.5f}"
                         f"{r['reference'][j]:>11.5f}{r['mask'][j]:>5}{(r['reward'] if r['reward'] is not None else float('nan')):>8.3f}"
                         f"{r['advantage']:>8.3f}{r['grad_sign'][j]:>5}")
    return "\n".join(lines)
