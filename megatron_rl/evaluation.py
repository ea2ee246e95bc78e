"""Held-out evaluation: fixed decoding, per-example outcomes, pass@1 and pass@k.

    megatron-rl eval --run RUN_DIR [--split test] [--samples N --k K] [--json]
    megatron-rl eval --model HF_DIR --config F [k=v ...] [--split test] [--json]

    result = evaluate(fleet, verifier, examples, template, tokenizer, Decoding())
    result.summary()    # {"reward", "correctness", "format", "verifier_errors", "pass@1", ...}
    result.outcomes     # one dict per example: responses, rewards, correctness

The decoding settings are fixed and recorded with every result: greedy (temperature 0, one
sample) by default; with `samples` N > 1 each example gets N samples at `temperature` with a
fixed seed, and pass@k uses the unbiased estimator of Chen et al. 2021 ("Evaluating Large
Language Models Trained on Code", eq. 1): for c correct out of n samples,
pass@k = 1 - C(n-c, k) / C(n, k), averaged over examples (a sample counts as correct only
with full correctness 1.0: some graders give partial credit, which the correctness mean keeps).

Correctness, format and the composite reward are reported apart.  A response the verifier
could not grade (timeout, crash) is excluded from the means and counted, never scored as
zero.  Eval starts no coordinator: nothing it generates can reach a training queue.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Sequence

import numpy as np


@dataclasses.dataclass(kw_only=True)
class Decoding:
    samples: int = 1
    """Samples per example (1: greedy pass@1)."""
    temperature: float = 0.0
    """0 = greedy; must be > 0 when samples > 1."""
    seed: int = 0
    """Request seed (example i uses seed + i), so a sampled eval is reproducible."""

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"eval samples must be >= 1, got {self.samples}")
        if self.temperature < 0:
            raise ValueError(f"eval temperature must be >= 0, got {self.temperature}")
        if self.samples > 1 and self.temperature == 0:
            raise ValueError("eval with samples > 1 needs temperature > 0 (greedy samples are all the same)")

    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "seed": self.seed}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from c correct of n samples: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def example_outcome(example, texts: Sequence[str], scores: Sequence) -> dict[str, Any]:
    """One example's record: its responses and their grades (None where grading failed)."""
    return {"id": example.id, "answer": example.answer, "responses": list(texts),
            "rewards": [sc.reward for sc in scores], "correctness": [sc.correctness for sc in scores],
            "format": [sc.format for sc in scores], "errors": sum(not sc.ok for sc in scores)}


@dataclasses.dataclass
class EvalResult:
    split: str
    decoding: Decoding
    outcomes: list[dict[str, Any]]
    """Per example: id, answer, responses, rewards/correctness/format (None where ungraded), errors."""

    def write(self, path) -> None:
        """Per-example outcomes as JSONL (one example a line), for pairwise comparisons."""
        from pathlib import Path

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for o in self.outcomes:
                f.write(json.dumps(o) + "\n")

    def summary(self, ks: Sequence[int] = (1,)) -> dict[str, Any]:
        """Means over the graded responses.  A grader that gives no correctness (a reward function without a
        "correct" component) has correctness, format and pass@k None: its reward is never called correctness."""
        flat = [(o["rewards"][j], o["correctness"][j], o["format"][j])
                for o in self.outcomes for j in range(len(o["responses"])) if o["rewards"][j] is not None]

        def mean(i: int) -> float | None:
            vals = [f[i] for f in flat if f[i] is not None]
            return float(np.mean(vals)) if vals else (float("nan") if not flat else None)

        out: dict[str, Any] = {
            "split": self.split, "examples": len(self.outcomes), "decoding": dataclasses.asdict(self.decoding),
            "reward": mean(0), "correctness": mean(1), "format": mean(2),
            "verifier_errors": sum(o["errors"] for o in self.outcomes),
        }
        for k in ks:
            if k > self.decoding.samples:
                raise ValueError(f"pass@{k} needs at least {k} samples per example, eval drew {self.decoding.samples}")
            per_example = []
            for o in self.outcomes:
                graded = [c for c in o["correctness"] if c is not None]
                if len(graded) >= k:
                    per_example.append(pass_at_k(len(graded), int(sum(c >= 1.0 for c in graded)), k))
            out[f"pass@{k}"] = (float(np.mean(per_example)) if per_example
                                else None if out["correctness"] is None else float("nan"))
        return out


def evaluate(fleet, verifier, examples: Sequence, template, tokenizer, decoding: Decoding,
             split: str = "test", env: dict | None = None) -> EvalResult:
    """Generate `decoding.samples` responses per example on `fleet`, grade them with `verifier`; with `env`
    (the `env:` section as a dict) each response is a multi-turn episode, scored by its environment."""
    n = decoding.samples
    if env is not None:
        from megatron_rl.rollout.episodes import episode_score

        samples = fleet.generate(list(examples), n=n, sampling=decoding.sampling(), env=env)
        scores = [episode_score(s.episode) for s in samples]
    else:
        from megatron_rl.rollout.sample import PromptInfo

        prompts = [template.encode(ex, tokenizer) for ex in examples]
        budgets = [PromptInfo(max_tokens=getattr(ex, "max_tokens", None)) for ex in examples]
        samples = fleet.generate(prompts, n=n, sampling=decoding.sampling(), info=budgets)  # each prompt's own budget
    texts = [tokenizer.decode(s.response_tokens, skip_special_tokens=True) for s in samples]
    if env is None:
        answers = [ex.reference for ex in examples for _ in range(n)]
        contexts = None
        if getattr(verifier.cfg, "function", None):  # a reward function also sees the prompt and the fields
            contexts = [{"prompt": tokenizer.decode(s.prompt_tokens, skip_special_tokens=True),
                         **examples[i // n].reward_fields()} for i, s in enumerate(samples)]
        scores = verifier.score(texts, answers, [len(s.response_tokens) for s in samples], contexts)
    outcomes = [example_outcome(ex, texts[i * n:(i + 1) * n], scores[i * n:(i + 1) * n])
                for i, ex in enumerate(examples)]
    return EvalResult(split=split, decoding=decoding, outcomes=outcomes)


def start_eval_ray(num_cpus: int) -> None:
    """Ray for an eval: the cluster at RAY_ADDRESS when one is set (a Slurm job, a script joined to one), else
    a cluster of its own on this node, listening on loopback only with a private token (platform/local_ray.py)."""
    import logging
    import os

    import ray

    from megatron_rl.platform.local_ray import local_ray_options

    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=num_cpus, logging_level=logging.WARNING, **local_ray_options())


def evaluate_model(model_dir, rollout_cfg, reward_cfg, examples: Sequence, template, decoding: Decoding,
                   split: str = "test", env: dict | None = None) -> EvalResult:
    """`evaluate` on a fresh vLLM engine serving the HF directory `model_dir` (no publication,
    no coordinator) with a verifier pool of `reward_cfg`; both are shut down afterwards.  With `env` (the
    `data.env` section as a dict) the examples are played as episodes of that environment."""
    from transformers import AutoTokenizer

    from megatron_rl.reward.pool import VerifierPool
    from megatron_rl.rollout.fleet import RolloutFleet

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    verifier = VerifierPool(reward_cfg)
    fleet = None
    try:
        fleet = RolloutFleet(dataclasses.replace(rollout_cfg, model=str(model_dir), weight_transfer="none"),
                             num_groups=1)
        return evaluate(fleet, verifier, examples, template, tokenizer, decoding, split=split, env=env)
    finally:
        verifier.close()
        if fleet is not None:
            fleet.shutdown()
