"""Gymnasium-style text environments as Environments: `reset`/`step` on strings.

    env = GymTextEnvironment(MyGymEnv(), name="wordle")
    question = env.reset(example)    # gym_env.reset(seed=<from example.id>, options={"example": ...})
    env.step("my move")              # gym_env.step(text) -> (obs, reward, terminated, truncated, info)

Anything that follows gymnasium's API (`reset(seed=, options=) -> (observation, info)`,
`step(action) -> (observation, reward, terminated, truncated, info)`) with string observations and
actions plugs in: TextArena / textworld-style games, BALROG-style text agents, a gymnasium.Env
subclass (gymnasium is not a dependency: the adapter is duck-typed).  `terminated or truncated`
ends the episode; the seed is derived from the example's id so runs are reproducible.  A wrong
return shape or a non-string observation raises EnvError (the episode's env_error).
"""

from __future__ import annotations

import hashlib
from typing import Any

from megatron_rl.envs.protocol import Environment, EnvError, StepResult


def example_seed(example_id: str) -> int:
    return int.from_bytes(hashlib.sha256(str(example_id).encode()).digest()[:4], "little")


class GymTextEnvironment(Environment):
    def __init__(self, gym_env: Any, *, name: str = "gym_text", observation_role: str = "user",
                 system_prompt: str | None = None):
        for method in ("reset", "step"):
            if not callable(getattr(gym_env, method, None)):
                raise TypeError(f"{type(gym_env).__name__} has no {method}(): not a gymnasium-style environment")
        self.gym_env = gym_env
        self.name = name
        self.observation_role = observation_role
        self._system_prompt = system_prompt

    @property
    def system_prompt(self) -> str | None:
        return self._system_prompt

    def reset(self, example: Any) -> str:
        returned = self.gym_env.reset(seed=example_seed(getattr(example, "id", example)),
                                      options={"example": example})
        if not (isinstance(returned, tuple) and len(returned) == 2):
            raise EnvError(f"{self.name}: reset must return (observation, info), got {type(returned).__name__}")
        return _text(self.name, returned[0])

    def step(self, action: str) -> StepResult:
        returned = self.gym_env.step(action)
        if not (isinstance(returned, tuple) and len(returned) == 5):
            raise EnvError(f"{self.name}: step must return (observation, reward, terminated, truncated, info), "
                           f"got {type(returned).__name__} of length {len(returned) if isinstance(returned, tuple) else '-'}")
        observation, reward, terminated, truncated, info = returned
        return StepResult(_text(self.name, observation), reward=None if reward is None else float(reward),
                          done=bool(terminated or truncated),
                          info={"truncated": bool(truncated), **(dict(info) if isinstance(info, dict) else {})})

    def close(self) -> None:
        close = getattr(self.gym_env, "close", None)
        if callable(close):
            close()


def _text(name: str, observation: Any) -> str:
    if not isinstance(observation, str):
        raise EnvError(f"{name}: observations must be strings, got {type(observation).__name__}")
    return observation
