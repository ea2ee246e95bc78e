"""LoRA on the learner, one process: the `learner.lora:` section's errors, and a TP1 Learner with adapters.

    python -m pytest tests/unit/test_lora.py -q

The config tests are pure.  The learner test runs in one spawned gloo process (Megatron import,
~20 s): a tiny Qwen3 Learner with adapters on qkv, proj, fc1 and fc2 gives the base model's logits at
step 0 (B = 0), only adapter parameters require grad or sit in the optimizer, and after optimizer
steps the base is bit-identical while the adapters (B at the first step, A at the second, once B is
non-zero) and the logits have moved.
"""

import types

import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.models.tp_layout import tp_kind
from megatron_rl.learner.config import LearnerConfig
from megatron_rl.models.lora import LoraConfig, model_problem
from megatron_rl.platform.spawn import run_distributed

TINY = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


@pytest.mark.parametrize("field, value, words", [
    ("rank", 0, "learner.lora.rank must be a positive integer"),
    ("rank", -4, "learner.lora.rank must be a positive integer"),
    ("rank", 2.5, "learner.lora.rank must be a positive integer"),
    ("alpha", 0, "learner.lora.alpha must be > 0"),
    ("dropout", 1.0, "learner.lora.dropout must be in [0, 1)"),
    ("target_modules", ["qkv", "o_proj"], "learner.lora.target_modules: unknown module 'o_proj'"),
    ("target_modules", [], "learner.lora.target_modules must name at least one"),
    ("target_modules", ["qkv", "qkv"], "learner.lora.target_modules names a module twice"),
])
def test_bad_lora_section_names_the_field(field, value, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace(")", r"\)")):
        LoraConfig(enabled=True, **{field: value})


def test_unknown_target_lists_the_documented_modules():
    with pytest.raises(ValueError) as err:
        LoraConfig(target_modules=["gate_proj"])
    for name in ("qkv", "proj", "fc1", "fc2"):
        assert f"{name}:" in str(err.value)


def test_scaling_is_alpha_over_rank():
    assert LoraConfig(rank=8, alpha=16).scaling == 2.0


def _train_config(overrides):
    from megatron_rl.train.config import load_train_config

    return load_train_config(None, ["model.tiny.arch=qwen3_moe", *overrides])


def test_routing_replay_composes_with_lora():
    """Issue 45 item 5: the adapters sit on attention and the routers replay experts (tests/dist/test_moe_routing.py
    runs both on one model); a MoE model's experts still take no adapters (models/lora.py model_problem)."""
    assert LearnerConfig(lora=LoraConfig(enabled=True), moe_routing_replay=True).moe_routing_replay
    cfg = _train_config(["learner.lora.enabled=true", "learner.moe_routing_replay=true"])
    assert cfg.learner.lora.enabled and cfg.learner.moe_routing_replay


def test_bad_lora_value_in_a_run_config_is_a_config_error():
    with pytest.raises(ConfigError, match="learner.lora.rank"):
        _train_config(["learner.lora.rank=0"])
    with pytest.raises(ConfigError, match="learner.lora.target_modules: unknown module 'down_proj'"):
        _train_config(["learner.lora.target_modules=[qkv,down_proj]"])


def test_lora_runs_are_accepted_and_what_they_cannot_do_is_refused_by_name():
    assert not _train_config([]).learner.lora.enabled
    assert _train_config(["learner.lora.enabled=true"]).learner.lora.enabled
    # Streaming serves adapters (each request keeps its version's adapter), and so do multi-turn episodes (each
    # turn keeps the adapter it started with: tests/e2e/test_lora_run.py runs one).
    assert _train_config(["learner.lora.enabled=true", "rollout.streaming=true", "run.mode=async"]).rollout.streaming
    episodes = _train_config(["learner.lora.enabled=true", "data.task=env", "data.env.name=guess_number",
                              "data.env.chat_template=plain", "rollout.streaming=true", "rollout.max_model_len=256",
                              "data.env.max_total_tokens=200"])
    assert episodes.learner.lora.enabled and episodes.data.env.enabled
    with pytest.raises(ConfigError, match="learner.lora.enabled with rollout.sleep_mode"):
        _train_config(["learner.lora.enabled=true", "rollout.sleep_mode=true"])
    with pytest.raises(ConfigError, match="rollout.adapter"):
        _train_config(["rollout.adapter={rank: 8}"])


def _model(moe=None, sequence_parallel=False, use_te=False):
    hf = types.SimpleNamespace(moe=moe, arch="qwen3_moe" if moe else "qwen3")
    config = types.SimpleNamespace(sequence_parallel=sequence_parallel)
    return hf, config, types.SimpleNamespace(use_te=use_te)


@pytest.mark.parametrize("model, targets, words", [
    (dict(moe=object()), ["qkv", "fc1"], "fc1/fc2 are its experts' layers"),
    (dict(moe=object()), ["fc2"], "fc1/fc2 are its experts' layers"),
    (dict(moe=object(), sequence_parallel=True), ["qkv"], "sequence parallelism"),
    (dict(use_te=True), ["proj"], "Transformer Engine"),
])
def test_unsupported_models_are_refused(model, targets, words):
    problem = model_problem(LoraConfig(enabled=True, target_modules=targets), *_model(**model))
    assert problem and words in problem and "learner.lora." in problem


def test_moe_attention_only_and_dense_models_are_accepted():
    assert model_problem(LoraConfig(enabled=True, target_modules=["qkv", "proj"]), *_model(moe=object())) is None
    assert model_problem(LoraConfig(enabled=True), *_model()) is None


@pytest.mark.parametrize("name, kind", [
    ("decoder.layers.0.self_attention.linear_qkv.adapter.lora_a", "replicated"),
    ("decoder.layers.0.self_attention.linear_qkv.adapter.lora_b", "column"),
    ("decoder.layers.0.self_attention.linear_proj.adapter.lora_a", "row"),
    ("decoder.layers.0.self_attention.linear_proj.adapter.lora_b", "replicated"),
    ("decoder.layers.0.mlp.linear_fc1.adapter.lora_a", "replicated"),
    ("decoder.layers.0.mlp.linear_fc1.adapter.lora_b", "fc1"),
    ("decoder.layers.0.mlp.linear_fc2.adapter.lora_a", "row"),
    ("decoder.layers.0.mlp.linear_fc2.adapter.lora_b", "replicated"),
])
def test_adapter_tensors_split_like_their_layer(name, kind):
    assert tp_kind(name) == kind


def _nll(logprobs_bt, mb):
    return -logprobs_bt.mean(), {"tokens": float(logprobs_bt.numel())}


def _learner_with_adapters(rank, world):
    from megatron_rl.conversion.model_io import canonical_params
    from megatron_rl.learner import Learner, LearnerConfig
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.models.lora import adapter_parameters, adapters_off, canonical_adapters
    from megatron_rl.platform import detect_platform
    from megatron_rl.publish.adapter_source import AdapterSource, adapter_shapes

    hf, platform = load_hf_config(TINY), detect_platform("cpu")
    tokens = torch.randint(0, TINY["vocab_size"], (4, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    lora = LoraConfig(enabled=True, rank=4, alpha=8)
    learner = Learner(LearnerConfig(global_batch_size=4, micro_batch_size=2, lr=1e-2, weight_decay=0.0, seed=5,
                                    lora=lora), hf, platform)
    module = learner.model[0].module
    base = build_gpt_model(hf, platform=platform, tp=1, pp=1, config=learner.config)
    missing, unexpected = base.load_state_dict(module.state_dict(), strict=False)
    adapters = adapter_parameters(module)
    out = {"unexpected": sorted(unexpected), "adapters": sorted(adapters),
           "trainable": sorted(n for n, p in module.named_parameters() if p.requires_grad),
           "canonical_has_adapter": any("lora" in n for n in canonical_params(module)),
           "b_zero": all(float(p.abs().max()) == 0 for n, p in adapters.items() if n.endswith("lora_b")),
           "a_nonzero": all(float(p.abs().max()) > 0 for n, p in adapters.items() if n.endswith("lora_a")),
           "optimizer_numel": sum(p.numel() for g in learner.optimizer.param_groups for p in g["params"]),
           "adapter_numel": sum(p.numel() for p in adapters.values())}
    with torch.no_grad():
        out["base_logits"] = base(tokens, pos, attention_mask=None)
        module.eval()
        out["logits0"] = module(tokens, pos, attention_mask=None)
    frozen0 = {n: p.detach().clone() for n, p in module.named_parameters() if n not in adapters}
    adapters0 = {n: p.detach().clone() for n, p in adapters.items()}
    out["step1"] = learner.train_step({"tokens": tokens}, _nll)
    adapters1 = {n: p.detach().clone() for n, p in adapters.items()}
    out["step2"] = learner.train_step({"tokens": tokens}, _nll)
    out["frozen_changed"] = [n for n, p in module.named_parameters() if n in frozen0 and not torch.equal(p, frozen0[n])]
    out["frozen_grads"] = [n for n, p in module.named_parameters()
                           if n in frozen0 and (p.grad is not None or getattr(p, "main_grad", None) is not None)]
    out["moved_step1"] = sorted(n for n in adapters if not torch.equal(adapters1[n], adapters0[n]))
    out["moved_step2"] = sorted(n for n, p in adapters.items() if not torch.equal(p.detach(), adapters1[n]))
    with torch.no_grad():
        module.eval()
        out["logits2"] = module(tokens, pos, attention_mask=None)
        for layer_module in module.modules():
            if hasattr(layer_module, "lora_a"):
                layer_module.dropout = 0.5
        module.train()  # dropout on the adapters' input: training forwards differ, eval ones do not
        out["dropout_logits"] = [module(tokens, pos, attention_mask=None) for _ in range(2)]
        module.eval()
        out["eval_logits"] = module(tokens, pos, attention_mask=None)
        with adapters_off(*learner.model):  # the reference of a LoRA run: the same model without its adapters
            out["off_logits"] = module(tokens, pos, attention_mask=None)
        out["on_again_logits"] = module(tokens, pos, attention_mask=None)
    # What a LoRA run publishes: PEFT-named TP1 adapters, exactly the tensors an engine expects.
    published = dict(AdapterSource(learner.model[0].module, hf, lora))
    out["published"] = {n: t.clone() for n, t in published.items()}
    out["expected_shapes"] = adapter_shapes(lora, hf)
    out["canonical"] = {n: p.detach().clone() for n, p in canonical_adapters(module).items()}
    learner.close()
    return out


@pytest.fixture(scope="module")
def trained():
    return run_distributed(_learner_with_adapters, 1, timeout=300)[0]


@pytest.mark.slow
def test_only_adapters_train(trained):
    assert trained["unexpected"] == trained["adapters"]  # the base model is the adapted one minus its adapters
    assert len(trained["adapters"]) == 2 * 4 * 2  # layers x targets x (A, B)
    assert trained["trainable"] == trained["adapters"]
    assert trained["optimizer_numel"] == trained["adapter_numel"]
    assert not trained["canonical_has_adapter"]
    assert trained["b_zero"] and trained["a_nonzero"]


@pytest.mark.slow
def test_step_zero_is_the_base_model_and_steps_move_only_adapters(trained):
    assert torch.equal(trained["logits0"], trained["base_logits"])
    assert trained["step1"]["update_successful"] == 1.0 and trained["step1"]["grad_norm"] > 0
    assert trained["frozen_changed"] == [] and trained["frozen_grads"] == []
    # Step 1: dA = B^T dy x^T is 0 while B = 0, so only B moves; step 2 moves both.
    assert trained["moved_step1"] == [n for n in trained["adapters"] if n.endswith("lora_b")]
    assert trained["moved_step2"] == trained["adapters"]
    assert (trained["logits2"] - trained["base_logits"]).abs().max() > 1e-3
    assert trained["step2"]["loss"] < trained["step1"]["loss"]


@pytest.mark.slow
def test_adapter_dropout_acts_in_training_only(trained):
    first, second = trained["dropout_logits"]
    assert not torch.equal(first, second) and not torch.equal(first, trained["logits2"])
    assert torch.equal(trained["eval_logits"], trained["logits2"])


@pytest.mark.slow
def test_adapters_off_gives_the_base_and_on_again_the_policy(trained):
    assert torch.equal(trained["off_logits"], trained["base_logits"])
    assert torch.equal(trained["on_again_logits"], trained["logits2"])


@pytest.mark.slow
def test_publication_is_the_peft_adapter_the_engine_expects(trained):
    published, canonical = trained["published"], trained["canonical"]
    assert {n: tuple(t.shape) for n, t in published.items()} == trained["expected_shapes"]
    prefix = "base_model.model.model.layers.1."
    qkv = "decoder.layers.1.self_attention.linear_qkv.adapter."
    for module in ("q_proj", "k_proj", "v_proj"):  # one A serves q, k and v
        assert torch.equal(published[f"{prefix}self_attn.{module}.lora_A.weight"], canonical[qkv + "lora_a"])
    b = canonical["decoder.layers.1.mlp.linear_fc1.adapter.lora_b"]  # [gate; up]
    assert torch.equal(published[f"{prefix}mlp.gate_proj.lora_B.weight"], b[:b.shape[0] // 2])
    assert torch.equal(published[f"{prefix}mlp.up_proj.lora_B.weight"], b[b.shape[0] // 2:])
    assert float(published[f"{prefix}mlp.up_proj.lora_B.weight"].abs().max()) > 0  # trained, not the zero init


@pytest.mark.slow
def test_steps_report_the_adapters_norm_and_update_ratio(trained):
    after = torch.sqrt(sum(t.double().square().sum() for t in trained["canonical"].values()))
    assert trained["step2"]["adapter_norm"] == pytest.approx(float(after), rel=1e-6)
    assert trained["step1"]["adapter_norm"] < trained["step2"]["adapter_norm"]
    assert 0 < trained["step1"]["adapter_update_ratio"] < 1 and 0 < trained["step2"]["adapter_update_ratio"] < 1


@pytest.mark.slow
def test_the_planner_counts_the_adapters_the_model_has(trained):
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.planner.ledger import LearnerLayout, adapter_params, dims_from_hf

    from megatron_rl.planner.training import AdapterTraining

    lay = LearnerLayout(training=AdapterTraining(rank=4, targets=("qkv", "proj", "fc1", "fc2")))
    assert adapter_params(dims_from_hf(load_hf_config(TINY)), lay) == trained["adapter_numel"]
