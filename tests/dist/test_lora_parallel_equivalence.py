"""One LoRA optimizer step at TP2 (and PP2) computes what it computes at TP1.

    python -m pytest tests/dist/test_lora_parallel_equivalence.py -q

One launch of 2 gloo processes builds a tiny random Qwen3 at TP1 with adapters on qkv, proj, fc1 and
fc2, and gives it random adapters (B too, so that A's gradient B^T dy x^T is not zero and every path
of the TP rule in megatron_rl/models/lora.py carries a gradient).  Each layout (TP1 DP2, TP2, PP2)
loads its shard of those weights (base and adapters split by models/tp_layout.py) and runs one
Learner step (Adam, weight decay, clip_grad, distributed optimizer).  Against TP1, within 1e-5:
logprobs before and after the step, loss, grad norm and the updated adapters.  Also: each layout's
own freshly initialised adapters are the shards of TP1's (one seeding rule for every layout), and
the base weights do not move.

Checkpoints, in the same launch: the TP2 and PP2 learners save after their step (WeightIO.save: adapters
and their optimizer state only, models/lora_checkpoint.py) and a fresh TP1 DP2 learner on the same base
loads each and takes a second step, which matches TP1's own second step within 1e-5 (the adapters and
Adam's moments came back, resharded on their split axes); the saved tensors are the adapters' alone.

Export, from the TP2 checkpoint: rank 0 writes the base as an HF directory; wrapped as a committed run
checkpoint that records the base's digest, `megatron-rl convert lora-export` writes the PEFT adapter and
the merged model, and transformers + PEFT (and the merged model alone) give the TP1 learner's logprobs
after its step within 1e-4.  Another base is refused by digest.
"""

import pytest
import torch

from megatron_rl.platform.spawn import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TINY = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tp, pp) on 2 ranks; the first (TP1, DP2) is the one compared against
OPT = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6, clip_grad=0.1)
LORA = dict(enabled=True, rank=4, alpha=8.0, target_modules=["qkv", "proj", "fc1", "fc2"], seed=11)
SEED = 7
SAVED = {(2, 1): "weights", (1, 2): "weights_pp2"}  # layouts that save after their step, and where


def _tokens():
    return torch.randint(0, TINY["vocab_size"], (4, 12), generator=torch.Generator().manual_seed(3))


def _nll(logprobs_bt, mb):
    return -logprobs_bt.mean(), {"tokens": float(logprobs_bt.numel())}


def _learner(cfg, platform, tp, pp):
    from megatron_rl.learner import Learner, LearnerConfig
    from megatron_rl.models.lora import LoraConfig

    return Learner(LearnerConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=1,
                                 global_batch_size=4, seed=SEED, use_distributed_optimizer=True,
                                 lora=LoraConfig(**LORA), **OPT), cfg, platform)


def _full_start(cfg, platform):
    """The TP1 model's state with its own initial adapters, and the same with random B's (the start)."""
    from megatron_rl.platform.parallel import parallel_scope

    with parallel_scope(tp=1, pp=1, seed=SEED):
        from megatron_rl.models.builder import build_gpt_model
        from megatron_rl.models.lora import LoraConfig

        model = build_gpt_model(cfg, platform=platform, tp=1, pp=1, lora=LoraConfig(**LORA))
        initial = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    gen = torch.Generator().manual_seed(5)
    start = {k: (torch.randn(v.shape, generator=gen) * 0.2 if k.endswith("lora_b") else v)
             for k, v in initial.items()}
    return initial, start


def _where(cfg, tp, pp):
    from megatron.core import parallel_state as ps

    return dict(tp=tp, tp_rank=ps.get_tensor_model_parallel_rank(), pp=pp, pp_rank=ps.get_pipeline_model_parallel_rank(),
                num_layers=cfg.num_layers, tie_word_embeddings=cfg.tie_word_embeddings, vocab_size=cfg.vocab_size)


def _resumed_step(cfg, platform, start, ckpt_dir, tokens):
    """A fresh TP1 DP2 learner on `start`'s base (its adapters fresh) loads `ckpt_dir` and steps once."""
    from megatron_rl.models.lora import adapter_parameters
    from megatron_rl.models.reshard import shard_state_dict
    from megatron_rl.ranks.weights import WeightIO

    learner = _learner(cfg, platform, 1, 1)
    module = learner.model[0].module
    adapters = adapter_parameters(module)
    module.load_state_dict({k: v for k, v in shard_state_dict(start, **_where(cfg, 1, 1)).items()
                            if k not in adapters}, strict=False)
    learner.optimizer.reload_model_params()
    WeightIO(torch.distributed.get_rank(), learner, cfg).load(str(ckpt_dir))
    out = {"loaded_logprobs": learner.forward_logprobs(tokens)}
    learner.train_step({"tokens": tokens}, _nll)
    out.update(logprobs2=learner.forward_logprobs(tokens),
               adapters2={n: p.detach().clone() for n, p in adapters.items()})
    learner.close()
    return out


def _write_hf_base(cfg, start, out):
    """The base of `start` (no adapters) as an HF directory: config.json, model.safetensors, a tokenizer.json."""
    import json

    from safetensors.torch import save_file

    from megatron_rl.conversion import mapping

    canon = {mapping.to_canonical_name(k): v for k, v in start.items() if ".adapter." not in k}
    hf = {}
    for group in mapping.groups(cfg):
        hf.update({n: t.contiguous().clone() for n, t in mapping.mcore_to_hf_group(cfg, group, canon)})
    out.mkdir(parents=True)
    save_file(hf, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**TINY, "model_type": "qwen3", "torch_dtype": "float32",
                                                 "tie_word_embeddings": False}))
    (out / "tokenizer.json").write_text('{"model": "none"}')


def _saved_keys(ckpt_dir):
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata)


def _equivalence(rank, world, root):
    from megatron.core import parallel_state as ps

    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.models.lora import LoraConfig, adapter_parameters
    from megatron_rl.platform import detect_platform
    from megatron_rl.models.reshard import shard_state_dict
    from megatron_rl.publish.adapter_source import AdapterSource

    cfg, platform, tokens = load_hf_config(TINY), detect_platform("cpu"), _tokens()
    initial, start = _full_start(cfg, platform)
    out, expected_after = {}, None
    for tp, pp in LAYOUTS:
        learner = _learner(cfg, platform, tp, pp)
        module = learner.model[0].module
        where = _where(cfg, tp, pp)
        adapters = adapter_parameters(module)
        own_init = shard_state_dict(initial, **where)
        result = {"init_diff": max((p - own_init[n]).abs().max().item() for n, p in adapters.items()),
                  "n_adapters": len(adapters)}
        local = shard_state_dict(start, **where)
        missing, unexpected = module.load_state_dict(local, strict=False)
        assert not unexpected and not [k for k in missing if not k.endswith("_extra_state")], (missing, unexpected)
        learner.optimizer.reload_model_params()  # the distributed optimizer keeps its own fp32 copy
        base_before = {n: p.detach().clone() for n, p in module.named_parameters() if n not in adapters}
        result["logprobs"] = learner.forward_logprobs(tokens)
        metrics = learner.train_step({"tokens": tokens}, _nll)
        result.update(loss=metrics["loss"], grad_norm=metrics["grad_norm"], adapter_norm=metrics["adapter_norm"],
                      adapter_update_ratio=metrics["adapter_update_ratio"],
                      logprobs_after=learner.forward_logprobs(tokens))
        # What a LoRA run publishes after the step: PEFT tensors gathered over TP and PP, on global rank 0.
        result["published"] = dict(AdapterSource(module, cfg, LoraConfig(**LORA)))
        result["base_moved"] = [n for n, p in module.named_parameters() if n in base_before
                                and not torch.equal(p, base_before[n])]
        if expected_after is None:  # TP1 PP1: every rank holds the whole model
            expected_after = {k: v.detach().clone() for k, v in module.state_dict().items() if k in start}
            learner.train_step({"tokens": tokens}, _nll)  # the second step a resumed learner must repeat
            step2 = {"logprobs2": learner.forward_logprobs(tokens),
                     "adapters2": {n: p.detach().clone() for n, p in adapters.items()}}
            module.load_state_dict(expected_after, strict=False)  # back to after step 1 for the checks below
        if (tp, pp) in SAVED:
            from megatron_rl.ranks.weights import WeightIO

            import multiprocessing

            proc = multiprocessing.current_process()
            daemon, proc.daemon = proc.daemon, False  # save starts a Manager; spawned ranks are daemonic
            try:
                WeightIO(rank, learner, cfg).save(str(root / SAVED[(tp, pp)]))
            finally:
                proc.daemon = daemon
        expected = shard_state_dict(expected_after, **where)
        result["max_adapter_diff"] = max((p - expected[n]).abs().max().item() for n, p in adapters.items())
        result["min_adapter_step"] = min((p - local[n]).abs().max().item() for n, p in adapters.items())
        learner.close()
        out[(tp, pp)] = result
    if rank == 0:
        _write_hf_base(cfg, start, root / "hf_base")
    out["resumed"] = {layout: _resumed_step(cfg, platform, start, root / name, tokens)
                      for layout, name in SAVED.items()}
    out["step2"], out["saved_keys"] = step2, _saved_keys(root / SAVED[(2, 1)])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_ckpt")
    out = run_distributed(_equivalence, 2, root, timeout=600)
    out[0]["dir"] = root
    return out


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=lambda l: f"tp{l[0]}pp{l[1]}")
def test_lora_step_matches_tp1(runs, layout):
    ref = runs[0][LAYOUTS[0]]
    assert ref["grad_norm"] > OPT["clip_grad"], "the step must actually clip"
    for rank, out in enumerate(runs):
        got = out[layout]
        torch.testing.assert_close(got["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        torch.testing.assert_close(got["logprobs_after"], ref["logprobs_after"], atol=1e-5, rtol=0)
        assert got["max_adapter_diff"] < 1e-5, f"rank {rank} layout {layout}: {got['max_adapter_diff']}"
        assert got["adapter_norm"] == pytest.approx(ref["adapter_norm"], rel=1e-5)
        assert got["adapter_update_ratio"] == pytest.approx(ref["adapter_update_ratio"], rel=1e-4)
    published, want = runs[0][layout]["published"], ref["published"]  # rank 0 sends; the others yield nothing
    assert sorted(published) == sorted(want) and len(want) > 0 and runs[1][layout]["published"] == {}
    for name, tensor in want.items():
        torch.testing.assert_close(published[name], tensor, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"tp{l[0]}pp{l[1]}")
def test_adapters_start_alike_train_and_the_base_stays(runs, layout):
    for rank, out in enumerate(runs):
        got = out[layout]
        assert got["n_adapters"] > 0
        assert got["init_diff"] == 0.0, f"rank {rank} layout {layout}: initial adapters differ from TP1's shard"
        assert got["min_adapter_step"] > 1e-5  # the step moved every adapter tensor, A's too (B is not zero)
        assert got["base_moved"] == []
        assert not torch.equal(got["logprobs_after"], got["logprobs"])


def test_checkpoint_holds_the_adapters_alone(runs):
    keys = runs[0]["saved_keys"]
    model_keys = [k for k in keys if not k.startswith("optimizer.")]
    assert model_keys and all(".adapter.lora_" in k for k in model_keys), model_keys
    optimizer_tensors = [k for k in keys if k.startswith("optimizer.") and ("decoder" in k or "embedding" in k)]
    assert optimizer_tensors and all(".adapter.lora_" in k for k in optimizer_tensors), optimizer_tensors


@pytest.mark.parametrize("saved", list(SAVED), ids=lambda l: f"saved_tp{l[0]}pp{l[1]}")
def test_resume_at_another_layout_repeats_the_second_step(runs, saved):
    for rank, out in enumerate(runs):
        got, want = out["resumed"][saved], out["step2"]
        assert not torch.equal(got["loaded_logprobs"], out[LAYOUTS[0]]["logprobs"])  # trained adapters came back
        torch.testing.assert_close(got["loaded_logprobs"], out[LAYOUTS[0]]["logprobs_after"], atol=1e-5, rtol=0)
        torch.testing.assert_close(got["logprobs2"], want["logprobs2"], atol=1e-5, rtol=0)
        for name, tensor in want["adapters2"].items():
            torch.testing.assert_close(got["adapters2"][name], tensor, atol=1e-5, rtol=0, msg=f"rank {rank} {name}")


@pytest.fixture(scope="module")
def run_checkpoint(runs):
    """RUN_DIR/checkpoints/step_000001: the TP2 learner's saved adapters, committed with the base's digest."""
    import json
    import shutil

    from megatron_rl.checkpoint import save_checkpoint
    from megatron_rl.conversion.lora_io import base_digest
    from megatron_rl.models.lora_checkpoint import BASE_DIGEST

    root = runs[0]["dir"]
    run_dir = root / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"model": {"path": str(root / "hf_base")}}))
    return save_checkpoint(run_dir / "checkpoints", 1, policy_version=1, config_hash="test",
                           save_fn=lambda tmp: shutil.copytree(root / "weights", tmp / "weights"),
                           extra={BASE_DIGEST: base_digest(root / "hf_base")})


def _hf_logprobs(model, tokens):
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def test_exported_adapter_and_merged_model_compute_the_learner(runs, run_checkpoint):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from megatron_rl.cli import main

    out = runs[0]["dir"]
    assert main(["convert", "lora-export", "--mcore", str(run_checkpoint), "--out", str(out / "peft"),
                 "--merged", str(out / "merged")]) == 0
    assert main(["convert", "mcore-to-hf", "--mcore", str(run_checkpoint), "--out", str(out / "merged2")]) == 0
    assert main(["convert", "lora-export", "--mcore", str(run_checkpoint), "--merged", str(out / "merged_bf16"),
                 "--dtype", "bf16"]) == 0
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(str(out / "merged_bf16"))
    assert bf16.dtype == torch.bfloat16 and not (out / "merged_bf16" / "adapter_config.json").exists()
    tokens, want = _tokens(), runs[0][LAYOUTS[0]]["logprobs_after"]  # TP1 after its step = the TP2 save
    base = transformers.AutoModelForCausalLM.from_pretrained(str(out / "hf_base")).eval()
    assert (_hf_logprobs(base, tokens) - want).abs().max() > 1e-3  # the adapters matter
    adapted = peft.PeftModel.from_pretrained(base, str(out / "peft")).eval()
    torch.testing.assert_close(_hf_logprobs(adapted, tokens), want, atol=1e-4, rtol=0)
    for merged in ("merged", "merged2"):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(out / merged)).eval()
        torch.testing.assert_close(_hf_logprobs(model, tokens), want, atol=1e-4, rtol=0)


def test_export_onto_another_base_is_refused_by_digest(runs, run_checkpoint):
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron_rl.config import ConfigError
    from megatron_rl.conversion.lora_io import export_lora_checkpoint

    other = runs[0]["dir"] / "other_base"
    shutil.copytree(runs[0]["dir"] / "hf_base", other)
    weights = load_file(str(other / "model.safetensors"))
    weights["model.norm.weight"] += 1.0
    save_file(weights, str(other / "model.safetensors"))
    with pytest.raises(ConfigError, match="trained on the base with digest blake3:.* has digest blake3:"):
        export_lora_checkpoint(run_checkpoint, runs[0]["dir"] / "refused", base=other)
    assert not (runs[0]["dir"] / "refused").exists()
