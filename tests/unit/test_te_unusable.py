"""A Transformer Engine that is installed but unusable leaves the CPU path working (issue 31, items 4 and 5).

    python -m pytest tests/unit/test_te_unusable.py -q

Item 4: TE installed but broken (its libraries do not load) used to end `import megatron.core`:
Megatron's guards catch ImportError, TE raises OSError.  A fake `transformer_engine` package whose
`pytorch` part raises OSError is put first on the path of a fresh Python (so it cannot leak into
this one), which must detect the platform, build the model on local layers and run a forward.
megatron_rl/te_import.py makes such a TE read as absent; the in-process tests pin its rules on fake
packages with a finder of their own.

Item 5: with TE importable, Megatron-Core builds the final norm from its module global
`transformer_block.LayerNormImpl` (TENorm), even for a CPU model with the local layer spec, and TE's
RMSNorm has no CPU kernel.  A spawned rank replaces that global with a norm that raises on CPU
tensors, as TENorm does; the CPU model must still build and run forward (its final norm comes from
the platform: platform.final_norm).
"""

import importlib
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_rl.platform.spawn import run_distributed

# The fast tier (`-m unit`) is given by tests/unit/conftest.py: every test here but the slow ones.

REPO = Path(__file__).resolve().parents[2]
TINY = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 32}
CAUSE = "libtransformer_engine.so: cannot open shared object file (fake)"


def _fake_te(root: Path, pytorch_source: str) -> Path:
    (root / "transformer_engine" / "pytorch").mkdir(parents=True)
    (root / "transformer_engine" / "__init__.py").write_text('__version__ = "2.11.0"\n')
    (root / "transformer_engine" / "pytorch" / "__init__.py").write_text(pytorch_source)
    return root


BUILD_AND_FORWARD = textwrap.dedent('''
    import json, os, sys, torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.platform import _te_available, detect_platform
    from megatron_rl.platform.parallel import init_distributed, parallel_scope
    platform = detect_platform()
    init_distributed(platform, rank=0, world_size=1)
    with parallel_scope(tp=1, pp=1, seed=3):
        model = build_gpt_model(load_hf_config(json.loads(sys.argv[2])), platform=platform, tp=1, pp=1)
        tokens = torch.randint(0, 64, (2, 8))
        logits = model(tokens, torch.arange(8).expand_as(tokens), attention_mask=None)
    import megatron.core.transformer.transformer_block as block
    print(json.dumps({"device": platform.device.type, "use_te": platform.use_te, "te_available": _te_available(),
                      "megatron_has_te": block.HAVE_TE, "finite": bool(torch.isfinite(logits).all()),
                      "norm": type(model.decoder.final_layernorm).__name__}))
''')


@pytest.mark.slow
def test_broken_te_leaves_platform_and_model_build_on_local_layers(tmp_path):
    fake = _fake_te(tmp_path / "fake", f"raise OSError({CAUSE!r})\n")
    env = {**os.environ, "PYTHONPATH": f"{fake}:{REPO}", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", BUILD_AND_FORWARD, "0", json.dumps(TINY)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"device": "cpu", "use_te": False, "te_available": False, "megatron_has_te": False,
                      "finite": True, "norm": "RMSNorm"}
    assert f"OSError: {CAUSE}" in out.stderr  # the reason is logged, not swallowed


@pytest.fixture
def own_finder(monkeypatch):
    """A fresh finder first on sys.meta_path; fake TE modules are removed from sys.modules afterwards."""
    from megatron_rl.te_import import BrokenTEFinder

    finder = BrokenTEFinder()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    assert "transformer_engine" not in sys.modules  # no real TE in this process to disturb
    yield finder
    for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
        del sys.modules[name]


def test_broken_te_import_is_a_module_not_found_error_naming_the_cause(tmp_path, monkeypatch, own_finder):
    from megatron_rl.te_import import TEUnavailable

    monkeypatch.syspath_prepend(str(_fake_te(tmp_path, f"raise OSError({CAUSE!r})\n")))
    with pytest.raises(ModuleNotFoundError, match="does not load .OSError: libtransformer_engine.so") as first:
        import transformer_engine  # noqa: F401  (the package loads; its PyTorch part does not)
    assert isinstance(first.value, TEUnavailable)
    assert not [m for m in sys.modules if m.startswith("transformer_engine")]  # nothing half-loaded left
    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine_torch"):
        with pytest.raises(ModuleNotFoundError, match="OSError: libtransformer_engine.so"):
            importlib.import_module(name)
    assert importlib.util.find_spec("transformer_engine") is not None  # still reads as installed


def test_working_te_loads_unchanged(tmp_path, monkeypatch, own_finder):
    monkeypatch.syspath_prepend(str(_fake_te(tmp_path, "KERNELS = 3\n")))
    import transformer_engine

    assert transformer_engine.__version__ == "2.11.0"
    assert sys.modules["transformer_engine.pytorch"].KERNELS == 3  # loaded with the package
    assert own_finder.message is None


def test_installed_once_first_on_the_meta_path():
    import megatron_rl  # noqa: F401  (installs it)
    from megatron_rl.te_import import BrokenTEFinder, install

    ours = [f for f in sys.meta_path if isinstance(f, BrokenTEFinder)]
    assert len(ours) == 1 and install() is ours[0]
    # ahead of the finders that load modules from files (a library imported later may put its own first: vLLM does)
    assert sys.meta_path.index(ours[0]) < sys.meta_path.index(importlib.machinery.PathFinder)


def _forward_with_gpu_only_final_norm(rank, world):
    import megatron.core.transformer.transformer_block as block

    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.platform import detect_platform
    from megatron_rl.platform.parallel import parallel_scope

    class GpuOnlyNorm(torch.nn.Module):  # TE's RMSNorm on a CPU tensor: no kernel
        def __init__(self, config, hidden_size, eps=1e-5):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden_size))

        def forward(self, x):
            if x.device.type == "cpu":
                raise RuntimeError("GpuOnlyNorm has no CPU kernel (as TE's RMSNorm)")
            return x * self.weight

    block.LayerNormImpl = GpuOnlyNorm  # what Megatron-Core picks for the final norm when TE imports
    with parallel_scope(tp=1, pp=1, seed=3):
        model = build_gpt_model(load_hf_config(TINY), platform=detect_platform("cpu"), tp=1, pp=1)
        tokens = torch.randint(0, 64, (2, 8))
        logits = model(tokens, torch.arange(8).expand_as(tokens), attention_mask=None)
    return {"norm": type(model.decoder.final_layernorm).__name__, "finite": bool(torch.isfinite(logits).all())}


@pytest.mark.slow
def test_cpu_model_final_norm_comes_from_the_platform_not_megatrons_te_default():
    (result,) = run_distributed(_forward_with_gpu_only_final_norm, 1)
    assert result == {"norm": "RMSNorm", "finite": True}
