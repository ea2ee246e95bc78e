"""A 2-step game written against gymnasium's API, made an Environment by GymTextEnvironment.

    data:
      env:
        name: examples/two_step_env/env.py:TwoStep     # or two_step_env.env:TwoStep (a package on PYTHONPATH)
        options: {bonus: 0.5}                          # checked against TwoStepConfig

The policy sees the example's question and answers; the game asks for the answer again; the episode earns
1 when both answers are the example's answer (plus `bonus` when the first one already was), 0 otherwise.
`TwoStepGame` is a plain gymnasium-style class (`reset(seed=, options=) -> (observation, info)`,
`step(action) -> (observation, reward, terminated, truncated, info)`); a `gymnasium.Env` subclass plugs in
the same way.  Rollout workers import this file by the same path; a module form's package is shipped to them
with the run's Ray job.
"""

from __future__ import annotations

import dataclasses

from megatron_rl.envs.gym_text import GymTextEnvironment


@dataclasses.dataclass(kw_only=True)
class TwoStepConfig:
    bonus: float = 0.0
    """Extra reward when the first answer is already right."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.bonus <= 1.0:
            raise ValueError(f"bonus must be in [0, 1], got {self.bonus}")


class TwoStepGame:
    """gymnasium's API on strings: the question, then "again:", then the verdict."""

    def __init__(self, config: TwoStepConfig):
        self.config = config
        self.answer, self.first = "", None

    def reset(self, *, seed=None, options=None):
        example = options["example"]
        self.answer, self.first = example.answer, None
        return f"{example.question}=", {}

    def step(self, action: str):
        said = action.strip()[:1]
        if self.first is None:
            self.first = said
            return "again:", None, False, False, {}
        right = said == self.answer and self.first == self.answer
        reward = float(right) + (self.config.bonus if self.first == self.answer else 0.0)
        return "", reward, True, False, {}


class TwoStep(GymTextEnvironment):
    name = "two_step"
    config_class = TwoStepConfig

    def __init__(self, config: TwoStepConfig):
        super().__init__(TwoStepGame(config), name="two_step", observation_role="user")
