"""Multi-turn environments (issue 28): the protocol, token-in/token-out episodes, built-in environments.

    from megatron_rl.envs.registry import get_environment
    env = get_environment("calculator", {"generator": "basic_arithmetic"})

protocol.py (Environment, StepResult, EpisodeLimits), episode.py (one token sequence and its
trajectory fields), chat_format.py (turn separators from the tokenizer's chat template), runner.py
(an episode driven turn by turn), metrics.py (the env/ panel), registry.py (environments by name),
and the environments: calculator.py (tool_calls.py: parsing, safe arithmetic; answers.py: final
answers), guess_number.py, python_tool.py (a subprocess sandbox: sandbox.py, sandbox_child.py),
gym_text.py (gymnasium-style text environments).  Not wired into rollout or training yet.
"""
