"""make-tiny-model: checkpoints load in transformers and vLLM, and vLLM agrees with HF.

    python -m pytest tests/e2e/test_tiny_model.py -x -q

vLLM runs in a subprocess script (it spawns its own EngineCore process), started once per
module; it writes sampled tokens and their logprobs to JSON, which the tests check against
transformers' log-softmax on the same checkpoint.
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
from megatron_rl.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, tokenizer_hash

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]

VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        model, prompts_json, out = sys.argv[1:4]
        prompts = json.loads(prompts_json)
        llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  max_model_len=256, seed=0)
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=1, logprobs=0,
                                detokenize=False, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        rows = []
        for o in outs:
            c = o.outputs[0]
            rows.append({"prompt": list(o.prompt_token_ids), "tokens": list(c.token_ids),
                         "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]})
        json.dump(rows, open(out, "w"))
    """
)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("m") / "llama"
    proc = _run_cli("make-tiny-model", "--arch", "llama", "--out", str(out), "--seed", "5")
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True), ("llama3", False), ("qwen3", True)])
def test_checkpoint_loads_in_transformers(tmp_path, arch, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_model(tmp_path / arch, arch=arch, seed=1, tie_embeddings=tied)
    tok = AutoTokenizer.from_pretrained(path)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    text = "12+7=19 The cat sat.\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text

    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.rope_parameters["rope_theta"] > 0
    assert cfg.vocab_size >= len(tok)
    assert cfg.tie_word_embeddings is tied
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tied
    has_bias = model.model.layers[0].self_attn.q_proj.bias is not None
    assert has_bias is (arch == "qwen2")
    assert hasattr(model.model.layers[0].self_attn, "q_norm") is (arch == "qwen3")
    assert cfg.head_dim == cfg.hidden_size // cfg.num_attention_heads * (2 if arch == "qwen3" else 1)
    assert cfg.rope_parameters.get("rope_type", "default") == ("llama3" if arch == "llama3" else "default")
    n = sum(p.numel() for p in model.parameters())
    assert 300_000 <= n <= 1_000_000
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_seed_determinism_and_overwrite_rules(tmp_path):
    from safetensors.torch import load_file

    a = make_tiny_model(tmp_path / "a", seed=3)
    b = make_tiny_model(tmp_path / "b", seed=3)
    c = make_tiny_model(tmp_path / "c", seed=4)
    ta, tb, tc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert ta.keys() == tb.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not torch.equal(ta["model.embed_tokens.weight"], tc["model.embed_tokens.weight"])

    with pytest.raises(FileExistsError, match=str(a)):
        make_tiny_model(a, seed=4)
    assert torch.equal(load_file(a / "model.safetensors")["model.embed_tokens.weight"], ta["model.embed_tokens.weight"])
    make_tiny_model(a, seed=4, force=True)
    assert torch.equal(load_file(a / "model.safetensors")["model.embed_tokens.weight"], tc["model.embed_tokens.weight"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left

    with pytest.raises(ValueError, match="vocab_size 50"):
        make_tiny_model(tmp_path / "d", vocab_size=50)
    with pytest.raises(ValueError, match="size 'huge'"):
        make_tiny_model(tmp_path / "d", size="huge")


def test_cli_refuses_non_empty_dir(tmp_path):
    out = tmp_path / "x"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = _run_cli("make-tiny-model", "--arch", "qwen2", "--out", str(out))
    assert proc.returncode == 2
    assert "not empty" in proc.stderr and str(out) in proc.stderr
    assert (out / "keep.txt").read_text() == "mine"


def test_tokenizer_hash(tmp_path, llama_dir):
    h = tokenizer_hash(llama_dir)
    assert len(h) == 64 and h == tokenizer_hash(make_tiny_model(tmp_path / "q", arch="qwen2", seed=9))
    # Reformatting the JSON keeps the hash; changing a token changes it.
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        data = json.loads((llama_dir / name).read_text())
        (copy / name).write_text(json.dumps(data, indent=7))
    assert tokenizer_hash(copy) == h
    data = json.loads((copy / "tokenizer.json").read_text())
    data["added_tokens"][2]["content"] = "<eos>"
    (copy / "tokenizer.json").write_text(json.dumps(data))
    assert tokenizer_hash(copy) != h
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        tokenizer_hash(tmp_path)


@pytest.mark.slow
def test_vllm_logprobs_match_transformers(tmp_path, llama_dir):
    from transformers import AutoModelForCausalLM

    prompts = [[BOS_ID, 23, 24, 17, 29], [BOS_ID, 78, 75, 82, 82, 85, 6], [BOS_ID, 40]]
    script = tmp_path / "gen.py"
    script.write_text(VLLM_SCRIPT)
    out = tmp_path / "out.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")  # one vLLM start-up, not two
    proc = subprocess.run(
        [sys.executable, str(script), str(llama_dir), json.dumps(prompts), str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert [r["prompt"] for r in rows] == prompts

    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    for row in rows:
        assert len(row["tokens"]) == 12 == len(row["logprobs"])
        seq = torch.tensor([row["prompt"] + row["tokens"]])  # [1, T]
        with torch.no_grad():
            logp = torch.log_softmax(model(seq).logits[0].double(), dim=-1)  # [T, V]
        n = len(row["prompt"])
        ref = logp[n - 1 : -1].gather(1, seq[0, n:, None]).squeeze(1)  # [R]
        got = torch.tensor(row["logprobs"], dtype=torch.float64)
        assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
