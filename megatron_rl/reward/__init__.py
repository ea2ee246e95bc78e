"""Rewards: the math answer verifier and the process pool that runs it with timeouts.

    from megatron_rl.reward import RewardConfig, VerifierPool, score_response
"""

from megatron_rl.reward.math_verifier import (
    EXTRACTORS,
    RewardConfig,
    Score,
    answers_match,
    extract_answer,
    overlong_penalty,
    parse_number,
    score_response,
)
from megatron_rl.reward.pool import ERROR_CODES, VerifierPool, summarize_scores

__all__ = [
    "ERROR_CODES", "EXTRACTORS", "RewardConfig", "Score", "VerifierPool", "answers_match", "extract_answer",
    "overlong_penalty", "parse_number", "score_response", "summarize_scores",
]
