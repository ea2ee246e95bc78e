"""What an SFT step learns from: a batch of examples made into tokens and a loss mask.

    make_batch = sft_batches(cfg, inputs, micro_batch_size)     # once per run (train/sft.py)
    batch = make_batch(examples)                                 # learner/sft_loss.py's layout

A prompt and its reference answer (or the example's worked solution, when it has one) then EOS, the loss on
those tokens; or, with `data.env`, the example's
demonstration episode played by its environment's expert (envs/demonstrations.py), the loss on the
assistant turns.
"""

from __future__ import annotations

from typing import Sequence

from megatron_rl.envs.demonstrations import Demonstrations, episode_sft_batch
from megatron_rl.learner.sft_loss import sft_rows_batch


def sft_batch(examples: Sequence, template, tokenizer, *, micro_batch_size: int) -> dict:
    """tokens [B, T] (prompt + answer + EOS, right-padded), loss_mask [B, T-1] on the answer and
    EOS predictions, lengths [B], and the batch's token count in the loss (the normaliser)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
    if eos is None:
        raise ValueError("SFT needs a tokenizer with an EOS token (the answer must learn to end)")
    rows = []
    for ex in examples:
        prompt = template.encode(ex, tokenizer)
        target = ex.solution or ex.answer  # a worked solution when the task has one
        answer = [int(i) for i in tokenizer(target, add_special_tokens=False)["input_ids"]] + [int(eos)]
        rows.append((prompt, answer, [1.0] * len(answer)))
    return sft_rows_batch(rows, pad_id=pad, micro_batch_size=micro_batch_size)


def sft_batches(cfg, inputs, micro_batch_size: int):
    """examples -> an SFT batch: each prompt with its reference answer, or, with `data.env`, each example's
    demonstration episode played by the environment's expert (envs/demonstrations.py: the loss on the
    assistant turns, never on an observation)."""
    if not cfg.data.env.enabled:
        return lambda examples: sft_batch(examples, inputs.template, inputs.tokenizer,
                                          micro_batch_size=micro_batch_size)
    demos = Demonstrations(cfg.data.env, inputs.tokenizer)
    pad = inputs.tokenizer.pad_token_id or 0
    return lambda examples: episode_sft_batch([demos.play(ex) for ex in examples], pad_id=pad,
                                              micro_batch_size=micro_batch_size)
