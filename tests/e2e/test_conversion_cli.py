"""The real `megatron-rl convert` CLI: round trip, `verify` JSON line, vLLM greedy parity.

    python -m pytest tests/e2e/test_conversion_cli.py -q      # Qwen3-MoE; all three: MEGATRON_RL_CONVERSION_ALL_ARCHS=1

Per architecture (Llama-3.x: a Llama with llama3 rope scaling, so plain Llama's path is covered
too; Qwen3: q/k norm, own head_dim; Qwen3-MoE: experts and router, verified at EP2 x PP2):
hf-to-mcore (TP2) -> verify at PP2 -> mcore-to-hf -> vLLM (CPU, one engine in a `__main__`-guarded subprocess) generates
greedily, token for token like transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_rl.models.tiny import make_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [[1, 40, 41, 42, 43], [1, 70, 33, 90, 12, 55, 60, 61]]
NEW_TOKENS = 12

VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys

    if __name__ == "__main__":
        from vllm import LLM, SamplingParams

        model_dir, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
        llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  max_model_len=64, gpu_memory_utilization=0.5)
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
    """
)


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", *args], capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"megatron-rl {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


@torch.no_grad()
def transformers_greedy(model_dir, prompts, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        for _ in range(n):
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        outs.append(ids[0, len(prompt):].tolist())
    return outs


# The dense architectures' round trips and logits at every layout are tests/dist/test_conversion.py's, and
# vLLM serving a dense tiny model like transformers is tests/e2e/test_tiny_model.py's: in the suite, the CLI
# path runs on Qwen3-MoE (experts, router, EP2 x PP2), the one only this module covers.  All three:
#   MEGATRON_RL_CONVERSION_ALL_ARCHS=1 python -m pytest tests/e2e/test_conversion_cli.py
_DENSE = pytest.mark.skipif(os.environ.get("MEGATRON_RL_CONVERSION_ALL_ARCHS") != "1",
                            reason="dense CLI round trips run on request (MEGATRON_RL_CONVERSION_ALL_ARCHS=1)")


@pytest.mark.parametrize("arch,architecture,ep", [pytest.param("llama3", "LlamaForCausalLM", 1, marks=_DENSE),
                                                  pytest.param("qwen3", "Qwen3ForCausalLM", 1, marks=_DENSE),
                                                  ("qwen3_moe", "Qwen3MoeForCausalLM", 2)])
def test_cli_roundtrip_verify_and_vllm(tmp_path, arch, architecture, ep):
    hf = make_tiny_model(tmp_path / "hf", arch=arch, seed=5)
    mc, back = tmp_path / "mc", tmp_path / "back"
    cli("convert", "hf-to-mcore", "--hf", str(hf), "--out", str(mc), "--tp", "2")
    assert json.loads((mc / "manifest.json").read_text())["architecture"] == architecture

    proc = cli("convert", "verify", "--hf", str(hf), "--mcore", str(mc), "--pp", "2", "--ep", str(ep))
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["max_abs_diff"] < 1e-4 and report["pp"] == 2 and report["ep"] == ep

    cli("convert", "mcore-to-hf", "--mcore", str(mc), "--out", str(back))
    expected = transformers_greedy(hf, PROMPTS, NEW_TOKENS)
    script = tmp_path / "vllm_greedy.py"
    script.write_text(VLLM_SCRIPT)
    # The engine core in this process: one start-up of vLLM, not two.
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    run = subprocess.run([sys.executable, str(script), str(back), json.dumps(PROMPTS), str(NEW_TOKENS)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert run.returncode == 0 and lines, f"vLLM failed ({run.returncode}):\n{run.stderr[-4000:]}"
    got = json.loads(lines[-1][len("TOKENS "):])
    assert got == expected
