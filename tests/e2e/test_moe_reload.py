"""vLLM's CPU MoE serves the weights a reload gives it: publication into Qwen3-MoE is exact.

    python -m pytest tests/e2e/test_moe_reload.py -q

One in-process vLLM engine (a script in a subprocess) serves a tiny Qwen3-MoE (model A) and
scores fixed prompts; then, through `reload_weights` (the path every publication takes),
it reloads A's own tensors, then another tiny Qwen3-MoE's (B, other seed), then A's again,
scoring after each.  Reloading identical weights must leave the prompt logprobs unchanged,
and after B they must be transformers' on B.  vLLM 0.32's reload alone leaves the CPU experts'
prepacked layout holding unpacked bytes (|dlogprob| up to ~1 nat); `disarm_moe_kernels` is
what makes these hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_rl.models.tiny import make_tiny_model

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 60, 33, 90, 12, 7, 100, 5, 64, 70]]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    from megatron_rl.publish.vllm_reload import checkpoint_tensors, reload_weights

    def score(llm, prompts):
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in outs]

    if __name__ == "__main__":
        model_a, model_b, prompts, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
        llm = LLM(model=model_a, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  max_model_len=64, seed=0, kv_cache_memory_bytes=64 << 20)
        config = llm.llm_engine.model_config
        rows = {"first": score(llm, prompts)}
        for step, path in (("reload_a", model_a), ("reload_b", model_b), ("back_to_a", model_a)):
            llm.apply_model(lambda model: reload_weights(model, config, checkpoint_tensors(path)))
            rows[step] = score(llm, prompts)
        json.dump(rows, open(out, "w"))
    """
)


def hf_prompt_logprobs(model_dir: Path) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = []
    with torch.no_grad():
        for p in PROMPTS:
            logp = torch.log_softmax(model(torch.tensor([p])).logits[0].double(), dim=-1)
            rows.append([float(logp[i, p[i + 1]]) for i in range(len(p) - 1)])
    return rows


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.fixture(scope="module")
def scores(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("moe_reload")
    model_a = make_tiny_model(tmp / "a", arch="qwen3_moe", seed=3)
    model_b = make_tiny_model(tmp / "b", arch="qwen3_moe", seed=4)
    script, out = tmp / "reload.py", tmp / "scores.json"
    script.write_text(SCRIPT)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(script), str(model_a), str(model_b), json.dumps(PROMPTS), str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = json.loads(out.read_text())
    rows["hf_a"], rows["hf_b"] = hf_prompt_logprobs(model_a), hf_prompt_logprobs(model_b)
    return rows


def test_serving_matches_transformers_before_any_reload(scores):
    assert max_diff(scores["first"], scores["hf_a"]) < 1e-4


def test_reloading_identical_weights_changes_nothing(scores):
    assert max_diff(scores["reload_a"], scores["first"]) < 1e-6
    assert max_diff(scores["back_to_a"], scores["first"]) < 1e-6


def test_reloaded_weights_are_served(scores):
    assert max_diff(scores["first"], scores["hf_b"]) > 1e-2  # B is another model
    assert max_diff(scores["reload_b"], scores["hf_b"]) < 1e-4
