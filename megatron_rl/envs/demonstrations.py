"""Demonstration episodes for supervised fine-tuning on an environment: its expert plays, token-in/token-out.

    demos = Demonstrations(env_cfg, tokenizer)           # the `data.env` section, the run's tokenizer
    episode = demos.play(example)                        # an Episode, laid out as a policy's own would be
    batch = episode_sft_batch([episode, ...], pad_id=0, micro_batch_size=4)   # the loss on assistant tokens only

The expert (`Environment.expert`) says each assistant turn.  Its text is tokenized once, as the policy's
sampled tokens would be (the text, then the chat format's end-of-turn token), and handed to the same
EpisodeRunner a rollout uses: the prompt, the observations, the turn separators and the terminal reason
are exactly those of a training episode.  SFT's loss is on the assistant tokens (action mask 1), never on
an observation.  An episode the expert did not bring to `done` (out of turns or tokens, an environment
error) is still a demonstration of the protocol; `play` returns it, and the caller decides.
"""

from __future__ import annotations

from megatron_rl.config import ConfigError
from megatron_rl.envs.chat_format import env_chat_format
from megatron_rl.envs.episode import Episode
from megatron_rl.envs.registry import get_environment, has_expert
from megatron_rl.envs.runner import EpisodeRunner
from megatron_rl.learner.sft_loss import sft_rows_batch


class Demonstrations:
    """Plays the expert of one `data.env` section's environment, with the run's tokenizer."""

    def __init__(self, cfg, tokenizer):
        if not has_expert(cfg.name):
            raise ConfigError(f"data.env.name {cfg.name!r}: this environment has no expert (Environment.expert), "
                              "so SFT has no demonstrations to learn from")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.chat = env_chat_format(cfg, tokenizer)
        self.limits = cfg.limits()

    def play(self, example) -> Episode:
        """One episode of `example` with the expert's turns (zero logprobs: nothing was sampled)."""
        env = get_environment(self.cfg.name, self.cfg.options)
        runner = EpisodeRunner(env, self.chat, self.limits)
        try:
            ep = runner.start(example)
            while not ep.finished:
                text = env.expert()
                tokens = [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
                tokens.append(self.chat.end_of_turn_id)
                if len(tokens) > ep.remaining_tokens:
                    runner.out_of_room(ep)
                    break
                runner.assistant_turn(ep, tokens, [0.0] * len(tokens), 0, text=text)
            return ep
        finally:
            env.close()


def episode_sft_batch(episodes: list[Episode], *, pad_id: int, micro_batch_size: int) -> dict:
    """The SFT batch of whole episodes (learner/sft_loss.py `sft_rows_batch`): the loss on their assistant
    tokens (action mask 1), none on the prompt or an observation."""
    return sft_rows_batch([(ep.prompt_tokens, ep.response_tokens, ep.action_mask) for ep in episodes],
                          pad_id=pad_id, micro_batch_size=micro_batch_size)
