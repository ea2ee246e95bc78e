"""What the learner sees of an episode (issue 28): observation tokens never get a gradient; the
sampled tokens are trained as sampled (never re-tokenized); a refit between turns is recorded.

    python -m pytest tests/unit/test_env_loss_mask.py -q
"""

from __future__ import annotations

import torch

from megatron_rl.envs.chat_format import ChatFormat
from megatron_rl.envs.episode import trajectory_fields
from megatron_rl.envs.example import Example
from megatron_rl.envs.guess_number import GuessNumberConfig, GuessNumberEnvironment
from megatron_rl.envs.protocol import EpisodeLimits
from megatron_rl.envs.runner import EpisodeRunner, run_episode
from megatron_rl.grpo.loss import grpo_loss
from megatron_rl.grpo.loss_config import GRPOLossConfig
from megatron_rl.trajectory import make_trajectory, validate
from tests.unit.tiny_chat import tiny_chat_tokenizer

HIDDEN = Example(id="g", question="Guess a number from 1 to 8.", answer="6")


def _guess_episode(tok, guesses, versions):
    """guess_number played by a scripted policy; each turn sampled by the given policy version and
    spelled byte by byte (in tiny_chat, token id b is byte b): a tokenization of "want to" that the
    tokenizer itself, which merges "an" and " to", would never produce."""
    env = GuessNumberEnvironment(GuessNumberConfig(low=1, high=8, max_guesses=4))
    runner = EpisodeRunner(env, ChatFormat(tok, observation_role="user"), EpisodeLimits(max_turns=4))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    sampled = []

    def generate(tokens, max_new):
        turn = list(f"I want to try {guesses[len(sampled)]}".encode()) + [im_end]
        sampled.append(turn)
        return turn, [-0.3] * len(turn), versions[len(sampled) - 1]
    return run_episode(runner, HIDDEN, generate), sampled


def test_sampled_tokens_are_kept_as_sampled_and_a_refit_between_turns_is_recorded():
    tok = tiny_chat_tokenizer()
    ep, sampled = _guess_episode(tok, [4, 7, 6], versions=[3, 3, 4])
    assert (ep.terminal_reason, ep.reward, ep.turns) == ("done", 1.0, 3)
    assistant = [ep.response_tokens[s.start:s.end] for s in ep.segments if s.kind == "assistant"]
    assert assistant == sampled
    retokenized = tok(tok.decode(sampled[0]), add_special_tokens=False)["input_ids"]
    assert retokenized != sampled[0]  # re-rendering the text would train on tokens the engine never sampled
    traj = make_trajectory(**trajectory_fields(ep), id="r/g/0", prompt_id="g", dataset_version="d",
                           tokenizer_hash="t", grader_version="guess@1", rollout_started_at=0.0, scored_at=1.0)
    assert validate(traj, current_version=4) == (3, 4) and traj.oldest_version == 3
    last = ep.segments[-1]
    assert set(traj.policy_versions[last.start:last.end].tolist()) == {4}
    assert set(traj.policy_versions[:ep.segments[-2].end].tolist()) == {3}


def _grads(logits_bt_v, tokens_bt, mask_bt, behavior_bt):
    logits = logits_bt_v.clone().requires_grad_(True)
    logprobs_bt = torch.log_softmax(logits, dim=-1).gather(-1, tokens_bt[..., None]).squeeze(-1)
    loss, _ = grpo_loss(logprobs_bt, behavior_bt, None, torch.tensor([1.5]), mask_bt,
                        GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.2))
    loss.backward()
    return loss.detach(), logits.grad


def test_observation_tokens_get_no_gradient_and_do_not_change_the_others():
    tok = tiny_chat_tokenizer()
    ep, _ = _guess_episode(tok, [4, 6], versions=[0, 0])
    f = trajectory_fields(ep)
    tokens_bt = torch.as_tensor(f["response_tokens"], dtype=torch.long)[None]
    mask_bt = torch.as_tensor(f["action_mask"], dtype=torch.float32)[None]
    behavior_bt = torch.as_tensor(f["behavior_logprobs"])[None]
    assert 0 < mask_bt.sum() < mask_bt.numel()  # both kinds of token are present
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, tokens_bt.shape[1], len(tok), generator=g)
    loss, grad = _grads(logits, tokens_bt, mask_bt, behavior_bt)
    observation = mask_bt[0] == 0
    assert grad[0, observation].abs().max() == 0
    assert grad[0, ~observation].abs().sum() > 0
    perturbed = logits.clone()
    perturbed[0, observation] += 5.0 * torch.randn(int(observation.sum()), len(tok), generator=g)
    loss2, grad2 = _grads(perturbed, tokens_bt, mask_bt, behavior_bt)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)
    unmasked, _ = _grads(perturbed, tokens_bt, torch.ones_like(mask_bt), behavior_bt)
    assert not torch.equal(unmasked, loss)  # the perturbation would matter if observations were trained
