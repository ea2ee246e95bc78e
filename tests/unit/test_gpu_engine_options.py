"""The GPU checks start vLLM eager, and the option gets to vLLM (issue 31, item 6).

    python -m pytest tests/unit/test_gpu_engine_options.py -q

On a GPU, vLLM starts compiled with CUDA graphs (enforce_eager=False, rollout/engine_setup.py): 1-2
minutes per cold engine.  The GPU checks ask for eager engines through rollout.engine_options
(tests/gpu/engine_options.py).  Checked here without a GPU: the option, given as a RolloutConfig
field or as the CLI override the checks pass, reaches the keyword arguments vllm.LLM gets for a GPU
engine (and the identity that decides which pooled engine a run may reuse); and every GPU check that
starts an engine, directly or through the CLI, passes it.
"""

import ast
from pathlib import Path

import pytest

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine_setup import engine_identity, llm_kwargs
from megatron_rl.train.config import load_train_config
from tests.gpu.engine_options import EAGER, EAGER_OVERRIDES

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
GPU_TESTS = REPO / "tests" / "gpu"


def test_eager_option_reaches_the_gpu_engine_arguments(tmp_path):
    plain = dict(model=str(tmp_path), weight_transfer="none")  # "none": no vLLM import for the backend's name
    assert llm_kwargs(RolloutConfig(**plain), on_gpu=True)["enforce_eager"] is False  # the default on GPUs
    assert llm_kwargs(RolloutConfig(**plain, engine_options=EAGER), on_gpu=True)["enforce_eager"] is True

    cfg = load_train_config(REPO / "configs/tiny_cpu_scratch.yaml", [f"run.dir={tmp_path / 'run'}", *EAGER_OVERRIDES])
    assert cfg.rollout.engine_options == {"enforce_eager": True}  # a bool, not the string "true"
    rollout = RolloutConfig(**{**vars(cfg.rollout), **plain})
    assert llm_kwargs(rollout, on_gpu=True)["enforce_eager"] is True
    compiled = RolloutConfig(**{**vars(cfg.rollout), **plain, "engine_options": {}})
    assert engine_identity(rollout, on_gpu=True) != engine_identity(compiled, on_gpu=True)  # not pooled together


def _starts_engines(tree: ast.AST) -> tuple[list[ast.Call], bool]:
    """The RolloutConfig(...) calls of a test module, and whether it runs the training CLI."""
    configs = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "RolloutConfig"]
    cli = any(isinstance(n, ast.Constant) and n.value == "megatron_rl.cli" for n in ast.walk(tree))
    return configs, cli


def test_every_gpu_check_that_starts_an_engine_starts_it_eager():
    seen = 0
    for path in sorted(GPU_TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        configs, cli = _starts_engines(tree)
        for call in configs:
            seen += 1
            options = [k.value for k in call.keywords if k.arg == "engine_options"]
            assert options and getattr(options[0], "id", None) == "EAGER", (
                f"{path.name}:{call.lineno}: RolloutConfig without engine_options=EAGER (tests/gpu/engine_options.py)")
        if cli:
            seen += 1
            names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            assert "EAGER_OVERRIDES" in names, f"{path.name} runs the CLI without EAGER_OVERRIDES in its overrides"
    assert seen >= 4  # the walk saw the checks that start engines (two direct, two through the CLI)


def test_cpu_engines_prefill_each_prompt_in_one_step(tmp_path):
    # vLLM's CPU runner dies rewinding a seeded sampler when a prompt's prefill is split over two steps (a
    # round of 16 x 16 prompts of ~30 tokens did, configs/tiny_cpu_reasoning.yaml with group_size 16).
    plain = dict(model=str(tmp_path), weight_transfer="none")
    assert llm_kwargs(RolloutConfig(**plain), on_gpu=False)["enable_chunked_prefill"] is False
    assert "enable_chunked_prefill" not in llm_kwargs(RolloutConfig(**plain), on_gpu=True)  # vLLM's default
