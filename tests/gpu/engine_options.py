"""vLLM engine options of the GPU checks: every engine they start is eager (issue 31, item 6).

    from tests.gpu.engine_options import EAGER, EAGER_OVERRIDES
    RolloutConfig(model=..., engine_options=EAGER)         # an engine a check starts itself
    megatron-rl train --config F ... rollout.engine_options.enforce_eager=true   # EAGER_OVERRIDES, the CLI

On a GPU, rollout/engine_setup.py starts vLLM with enforce_eager=False: torch.compile and CUDA-graph
capture, 1-2 minutes per cold engine.  The checks test publication, sleep/wake, refit and logprobs,
not compiled kernels, so they start engines eager through `rollout.engine_options` (passed to
vllm.LLM as they are, and winning over the arguments derived from the config).  The price: the GPU
checks do not exercise the compiled CUDA-graph engine that a GPU training run uses by default.
tests/unit/test_gpu_engine_options.py checks that the option reaches vLLM's arguments and that every
check starting an engine uses it.
"""

EAGER = {"enforce_eager": True}
"""rollout.engine_options of an engine a GPU check starts itself (a RolloutConfig)."""
EAGER_OVERRIDES = ["rollout.engine_options.enforce_eager=true"]
"""The same as config overrides, for the checks that run the CLI."""
