"""The `learner.lora:` section of the run config: which linear layers get low-rank adapters, their rank and
scale (the adapters themselves: models/lora.py).  Pure Python, so that reading a config imports no torch.

    lora = LoraConfig(enabled=True, rank=8, alpha=16, target_modules=["qkv", "proj"])
"""

from __future__ import annotations

import dataclasses

TARGET_MODULES = {
    "qkv": "attention's fused query/key/value projection (linear_qkv, column parallel)",
    "proj": "attention's output projection (linear_proj, row parallel)",
    "fc1": "the MLP's up and gate projection (linear_fc1, column parallel)",
    "fc2": "the MLP's down projection (linear_fc2, row parallel)",
}
"""The linear layers an adapter can sit beside, by the name `learner.lora.target_modules` uses."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes as max_lora_rank (vllm/config/lora.py, MaxLoRARanks): the rollout engines serve an
adapter of rank r with the smallest of them >= r, so a LoRA run's rank can be at most the last."""


@dataclasses.dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters on a frozen base: which layers get them, their rank and scale."""

    enabled: bool = False
    """Train adapters only; the base weights stay frozen (false: every parameter trains)."""
    rank: int = 16
    """r: the inner dimension of each adapter (A is [r, in], B is [out, r])."""
    alpha: float = 32.0
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training.  0 suits RL: with dropout the training forward
    is not the policy whose logprobs scored the rollout."""
    target_modules: list[str] = dataclasses.field(default_factory=lambda: list(TARGET_MODULES))
    """Which linear layers of every transformer layer get an adapter: any of qkv, proj, fc1, fc2."""
    seed: int = 0
    """Seed of the A matrices' initialisation (B starts at zero)."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"learner.lora.rank must be a positive integer, got {self.rank!r}")
        if self.enabled and self.rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"learner.lora.rank {self.rank} is more than the rollout engines serve: vLLM's LoRA "
                             f"takes rank <= {VLLM_LORA_RANKS[-1]} (max_lora_rank one of {list(VLLM_LORA_RANKS)})")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"learner.lora.alpha must be > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"learner.lora.dropout must be in [0, 1), got {self.dropout!r}")
        targets = list(self.target_modules)
        if not targets:
            raise ValueError(f"learner.lora.target_modules must name at least one of {', '.join(TARGET_MODULES)}")
        for name in targets:
            if name not in TARGET_MODULES:
                raise ValueError(f"learner.lora.target_modules: unknown module {name!r}; the modules are "
                                 + "; ".join(f"{k}: {v}" for k, v in TARGET_MODULES.items()))
        if len(set(targets)) != len(targets):
            raise ValueError(f"learner.lora.target_modules names a module twice: {targets}")
        self.target_modules = targets

    @property
    def label(self) -> str:
        """What trains, for the run manifest, the summary and reports: "full" or the LoRA settings."""
        if not self.enabled:
            return "full"
        return f"LoRA rank {self.rank}, alpha {self.alpha:g} ({', '.join(self.target_modules)}; base frozen)"

    def serving(self, versions: int) -> dict | None:
        """What the rollout engines of a run with these adapters serve (RolloutConfig.adapter): each version
        an adapter on the base, the newest `versions` kept (the coordinator's admissible window); None when
        LoRA is off (the engines take every version's full weights)."""
        return {**self.record(), "versions": int(versions)} if self.enabled else None

    def record(self) -> dict:
        """The adapters' shape and scale as plain data (a checkpoint's lora.json, models/lora_checkpoint.py)."""
        return {"rank": self.rank, "alpha": float(self.alpha), "target_modules": list(self.target_modules)}

    @property
    def scaling(self) -> float:
        """alpha / r, the factor on B A x."""
        return float(self.alpha) / self.rank
