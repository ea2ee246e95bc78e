"""Planner ledger against numbers computed by hand (see the comments for each step)."""

import dataclasses
from pathlib import Path

import pytest

from megatron_rl.planner.ledger import (
    GIB, LearnerLayout, ModelDims, RolloutLayout, compare_placements, kv_cache_bytes,
    learner_ledger, rollout_ledger,
)
from megatron_rl.planner.training import FULL, AdapterTraining

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]

SMALL = ModelDims(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)


def test_param_count_by_hand():
    # attention: q 64*64 + k,v 2*64*32 + o 64*64 = 12288; mlp 3*64*128 = 24576; norms 128
    # 2 layers * 36992 + embeddings 2*1000*64 + final norm 64 = 202048
    assert SMALL.num_params == 202048


def test_qwen2_7b_param_count_matches_published_size():
    qwen7b = ModelDims(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                       num_heads=28, num_kv_heads=4, head_dim=128)
    assert abs(qwen7b.num_params / 1e9 - 7.61) < 0.01


def test_learner_ledger_by_hand():
    lay = LearnerLayout(tp=1, pp=1, dp=2, dtype="bf16", grad_reduce_in_fp32=True,
                        use_distributed_optimizer=True, micro_batch_size=1, seq_length=16,
                        reference_model=True, ddp_bucket_params=1000)
    led = learner_ledger(SMALL, lay, reserve_fraction=0.1)
    p = 202048
    expected = {
        "weights": p * 2, "grads": p * 4, "master_weights": p * 4 / 2, "optimizer_states": p * 8 / 2,
        "reference_model": p * 2,
        "activations": 2 * 1 * 16 * 1 * 64 * 34,  # layers * inflight * s*b*h*(10+24/tp)
        "logits": 16 * 1000 * 4 * 2, "comm_buffers": 2 * 1000 * 4,
        "cuda_context": GIB, "publish": 2 * 1000 * 64 * 2,  # V x h in bf16, gathered + full
    }
    for key, val in expected.items():
        assert led.items[key] == pytest.approx(val), key
    base = 3034304 + GIB + 256000
    assert led.items["reserve"] == pytest.approx(0.1 * base)
    assert led.total == pytest.approx(base * 1.1)
    # Between steps the activations, logits and publication gathers are released.
    assert led.resident() == pytest.approx((base - expected["activations"] - 128000 - 256000) * 1.1)


def test_unsharded_bytes_per_param_in_documented_range():
    lay = LearnerLayout(dp=1, dtype="bf16", use_distributed_optimizer=False, reference_model=False)
    led = learner_ledger(SMALL, lay, reserve_fraction=0.0)
    per_param = sum(led.items[k] for k in ("weights", "grads", "master_weights", "optimizer_states"))
    assert per_param / SMALL.num_params == 18
    lay32 = LearnerLayout(dp=1, dtype="fp32", use_distributed_optimizer=False, reference_model=False)
    led32 = learner_ledger(SMALL, lay32, reserve_fraction=0.0)
    per_param32 = sum(led32.items[k] for k in ("weights", "grads", "master_weights", "optimizer_states"))
    assert per_param32 / SMALL.num_params == 16


def test_kv_cache_formula():
    roll = RolloutLayout(tp=2, max_num_seqs=8, max_model_len=100, dtype="bf16")
    # 2 * B * L * H_kv * d * T * bytes / TP = 2*8*2*2*16*100*2/2
    assert kv_cache_bytes(SMALL, roll) == 2 * 8 * 2 * 2 * 16 * 100 * 2 / 2


def test_7b_does_not_fit_one_small_gpu_and_names_largest_item():
    qwen7b = ModelDims(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                       num_heads=28, num_kv_heads=4, head_dim=128)
    lay = LearnerLayout(tp=1, pp=1, dp=1, use_distributed_optimizer=False)
    roll = RolloutLayout(tp=1, groups=1)
    led, rled = learner_ledger(qwen7b, lay, 0.15), rollout_ledger(qwen7b, roll, 0.15)
    verdicts = {v.placement: v for v in compare_placements(led, rled, lay, roll, gpu_memory_gib=80, gpus_available=8)}
    assert not verdicts["colocated"].fits and not verdicts["disaggregated"].fits
    assert verdicts["colocated"].largest_item == "learner/optimizer_states"
    # Sharding the optimizer over 8 ranks with TP=2 (4 DP) brings it within 80 GiB.
    lay8 = LearnerLayout(tp=2, pp=1, dp=4, use_distributed_optimizer=True, activation_checkpointing=True)
    roll8 = RolloutLayout(tp=1, groups=8, max_num_seqs=64, max_model_len=2048)  # colocated on GPUs: rollout TP1
    led8, rled8 = learner_ledger(qwen7b, lay8, 0.15), rollout_ledger(qwen7b, roll8, 0.15)
    col = compare_placements(led8, rled8, lay8, roll8, gpu_memory_gib=80, gpus_available=8)
    assert col[1].placement == "colocated" and col[1].fits and col[1].peak_bytes_per_gpu < 80 * GIB


QWEN7B = ModelDims(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                   num_heads=28, num_kv_heads=4, head_dim=128)


def test_engine_takes_its_whole_budget_and_needs_to_fit_in_it():
    roll = RolloutLayout(tp=1, groups=8, max_num_seqs=64, max_model_len=2048, gpu_memory_utilization=0.4)
    rled = rollout_ledger(QWEN7B, roll, 0.15, gpu_memory_gib=80)
    assert rled.total == pytest.approx(0.4 * 80 * GIB) and rled.need < rled.total
    small = RolloutLayout(tp=1, groups=8, max_num_seqs=64, max_model_len=2048, gpu_memory_utilization=0.2)
    lay = LearnerLayout(tp=2, pp=1, dp=4, activation_checkpointing=True)
    led = learner_ledger(QWEN7B, lay, 0.15)
    verdicts = compare_placements(led, rollout_ledger(QWEN7B, small, 0.15, 80), lay, small, 80, 8)
    assert not any(v.fits for v in verdicts) and all("more than its budget" in v.note for v in verdicts)


def test_colocated_peak_counts_the_resident_learner_and_the_budget():
    """The 7B colocated layout at gpu_memory_utilization 0.4 (32 GiB): without sleep mode the
    learner's whole footprint sits next to vLLM's budget (does not fit 80 GiB); with it, the
    rollout phase (resident learner + budget) is the peak."""
    lay = LearnerLayout(tp=2, pp=1, dp=4, activation_checkpointing=True)
    roll = RolloutLayout(tp=1, groups=8, max_num_seqs=64, max_model_len=2048, gpu_memory_utilization=0.4)
    led, rled = learner_ledger(QWEN7B, lay, 0.15), rollout_ledger(QWEN7B, roll, 0.15, 80)
    publication = led.total * led.items["publish"] / (led.total - led.items["reserve"])
    awake = compare_placements(led, rled, lay, roll, 80, 8, sleep_mode=False)[1]
    assert awake.phases["learn phase"] == pytest.approx(led.total - publication + rled.total) and not awake.fits
    assert awake.peak_bytes_per_gpu == pytest.approx(max(led.resident() + publication, led.total - publication)
                                                     + rled.total)
    asleep = compare_placements(led, rled, lay, roll, 80, 8, sleep_mode=True)[1]
    assert asleep.peak_bytes_per_gpu == pytest.approx(max(led.resident() + publication + rled.total,
                                                          led.total - publication + 2 * GIB))
    assert asleep.peak_bytes_per_gpu > max(led.total, rled.total)  # the old max(learner, rollout) was optimistic


RECIPES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "configs").glob("*.yaml"))


def test_every_recipe_is_planned():
    assert "configs/qwen3_8b_8gpu_colocated.yaml" in RECIPES and len(RECIPES) >= 7


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_start_and_fit_with_ten_percent_margin(recipe):
    """Every shipped recipe, planned for GPUs: its configured placement can start there
    (train/placement.py's rule) and fits with >= 10% margin, its engine within its budget."""
    from megatron_rl.plan_cli import plan_for_config
    from megatron_rl.train.config import load_train_config
    from megatron_rl.planner.startability import startability_problem

    cfg = load_train_config(REPO / recipe, [])
    assert startability_problem(cfg.run.placement, cfg.rollout.tensor_parallel_size, gpu=True) is None
    plan = plan_for_config(cfg)
    chosen = next(v for v in plan["placements"] if v["placement"] == plan["configured_placement"])
    assert chosen["startable"] and chosen["fits"] and chosen["margin"] >= 0.10, chosen
    assert plan["rollout_need_gib"] <= plan["rollout_budget_gib"]


def test_colocated_rollout_tp_above_one_cannot_start_on_gpus_whatever_the_memory():
    """The planner asks Placement.create's rule (train/placement.py): a colocated group's vLLM TP
    workers cannot span Ray bundles, so on GPUs colocated needs rollout TP 1. The same layout at
    TP1 fits, so the refusal is the rule, not memory; on CPU the rule allows TP>1 (tests use it)."""
    from megatron_rl.planner.startability import startability_problem

    lay = LearnerLayout(tp=4, pp=1, dp=2, activation_checkpointing=True)
    verdicts = {}
    for tp in (1, 2):
        roll = RolloutLayout(tp=tp, groups=8 // tp, max_num_seqs=16, max_model_len=2048, gpu_memory_utilization=0.3)
        led, rled = learner_ledger(QWEN7B, lay, 0.15), rollout_ledger(QWEN7B, roll, 0.15, 80)
        verdicts[tp] = {v.placement: v for v in compare_placements(led, rled, lay, roll, 80, 16, sleep_mode=False)}
    assert verdicts[1]["colocated"].fits and verdicts[1]["colocated"].startable
    col2 = verdicts[2]["colocated"]
    assert col2.peak_bytes_per_gpu < 80 * GIB  # memory alone would fit
    assert not col2.startable and not col2.fits
    assert col2.blocker == startability_problem("colocated", 2, gpu=True)
    assert "run.placement 'colocated'" in col2.blocker and "rollout.tensor_parallel_size 1 (got 2)" in col2.blocker
    assert verdicts[2]["disaggregated"].startable and verdicts[2]["disaggregated"].blocker is None
    assert startability_problem("colocated", 2, gpu=False) is None  # CPU: nominal bundles, any TP
    assert startability_problem("disaggregated", 4, gpu=True) is None


def test_plan_command_refuses_a_colocated_recipe_at_rollout_tp_two(capsys):
    """`megatron-rl plan` exits 1 for a configured layout that cannot start, naming both fields."""
    from megatron_rl.cli import main

    recipe = str(REPO / "configs/qwen3_8b_8gpu_colocated.yaml")
    assert main(["plan", "--config", recipe, "rollout.tensor_parallel_size=2", "rollout.data_parallel_size=4"]) == 1
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("colocated ") and "GPUs, peak" in ln)
    assert "CANNOT START" in line and "rollout.tensor_parallel_size 1 (got 2)" in line, line


def test_sleep_mode_is_counted_exactly_when_the_driver_sleeps():
    """The planner asks the driver's own rule (rollout/sleep.py): one_step_off generates while the
    learner learns (engine counted awake); sync colocated on GPUs sleeps (counted asleep)."""
    from megatron_rl.plan_cli import plan_for_config
    from megatron_rl.train.config import load_train_config

    recipe = REPO / "configs/qwen2_7b_8gpu_colocated.yaml"
    awake = plan_for_config(load_train_config(recipe, []))
    sync = ["run.mode=sync"]
    asleep = plan_for_config(load_train_config(recipe, sync))
    off = plan_for_config(load_train_config(recipe, sync + ["rollout.sleep_mode=false"]))
    assert not awake["colocated_sleep_mode"] and "one_step_off" in awake["sleep_mode_reason"]
    assert asleep["colocated_sleep_mode"] and not off["colocated_sleep_mode"]
    peak = {name: {p["placement"]: p["peak_gib_per_gpu"] for p in plan["placements"]}
            for name, plan in (("awake", awake), ("asleep", asleep), ("off", off))}
    learn = {name: next(p for p in plan["placements"] if p["placement"] == "colocated")["phases"]["learn phase"]
             for name, plan in (("awake", awake), ("asleep", asleep), ("off", off))}
    assert learn["asleep"] < learn["awake"] == learn["off"]
    assert peak["asleep"]["colocated"] <= peak["awake"]["colocated"] == peak["off"]["colocated"]
    assert peak["asleep"]["disaggregated"] == peak["awake"]["disaggregated"]


def test_ipc_publication_is_counted_as_a_resident_whole_model_copy():
    """The ipc transport copies every publication into a staging buffer it keeps (publish/ipc_staging.py):
    the learner's publish_staging item is the whole model in the engine's dtype, and the recipe still fits."""
    from megatron_rl.plan_cli import plan_for_config
    from megatron_rl.train.config import load_train_config

    recipe = REPO / "configs/qwen2_1.5b_1gpu.yaml"
    ipc = plan_for_config(load_train_config(recipe, []))  # weight_transfer auto, colocated: ipc
    gloo = plan_for_config(load_train_config(recipe, ["rollout.weight_transfer=gloo"]))
    assert ipc["learner_gib_per_gpu"]["publish_staging"] == pytest.approx(ipc["model_params"] * 2 / GIB)
    assert "publish" not in ipc["learner_gib_per_gpu"]
    assert gloo["learner_gib_per_gpu"]["publish"] < ipc["learner_gib_per_gpu"]["publish_staging"] / 2  # 2 V h
    col = {p["placement"]: p for p in ipc["placements"]}["colocated"]
    assert col["fits"] and col["margin"] >= 0.10, col


def test_the_ipc_staging_copy_is_counted_in_every_phase():
    """With ipc every engine GPU keeps a whole-model staging copy from one publication to the next:
    it is resident, so the rollout, refit and learn phases all count it."""
    lay = LearnerLayout(tp=4, pp=1, dp=2, activation_checkpointing=True, publish_whole_model=True)
    roll = RolloutLayout(tp=1, groups=8, max_num_seqs=32, max_model_len=2048, gpu_memory_utilization=0.3)
    led, rled = learner_ledger(QWEN7B, lay, 0.15), rollout_ledger(QWEN7B, roll, 0.15, 80)
    staging = led.total * led.items["publish_staging"] / (led.total - led.items["reserve"])
    assert led.items["publish_staging"] == QWEN7B.num_params * 2 and "publish" not in led.items
    without = learner_ledger(QWEN7B, LearnerLayout(tp=4, pp=1, dp=2, activation_checkpointing=True), 0.15)
    assert led.resident() - without.resident() == pytest.approx(staging, rel=0.01)  # the copy, plus its reserve
    col = compare_placements(led, rled, lay, roll, 80, 8, sleep_mode=False)[1]
    assert col.phases["learn phase"] == pytest.approx(led.total + rled.total)  # the copy stays while learning
    assert col.phases["rollout phase"] == pytest.approx(led.resident() + rled.total)
    assert col.phases["rollout phase"] > staging + rled.total


MOE = ModelDims(vocab_size=1000, hidden_size=64, intermediate_size=0, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, num_experts=8, moe_ffn_hidden_size=32, moe_top_k=2)


def test_moe_params_and_expert_rows_by_hand():
    # experts: 2 layers * 8 * 3*64*32 = 98304; routers 2 * 8*64 = 1024; attention 2 * 12288, norms 2 * 128,
    # embeddings 128000, final norm 64 -> 98304 + 1024 + 24576 + 256 + 128064 = 252224
    assert MOE.expert_params == 98304 and MOE.num_params == 252224
    assert MOE.active_params == 252224 - 98304 * 6 // 8  # top-2 of 8 experts
    lay = LearnerLayout(tp=1, pp=2, dp=4, ep=4, dtype="bf16", micro_batch_size=1, seq_length=16,
                        reference_model=False, ddp_bucket_params=0, cuda_context_gib=0)
    items = learner_ledger(MOE, lay, 0.0).items
    shard = 98304 / (4 * 1 * 2)  # experts over EP x TP x PP
    assert items["expert_weights"] == shard * 2 and items["expert_grads"] == shard * 4
    assert items["expert_optimizer_states"] == shard * 8 / (4 // 4)  # expert DP = DP / EP = 1: unsharded
    assert items["weights"] == (252224 - 98304) / 2 * 2  # routers stay with the dense params, over TP x PP
    assert items["optimizer_states"] == (252224 - 98304) / 2 * 8 / 4
    assert items["moe_dispatch"] == 1 * 2 * 16 * 1 * 2 * (2 * 64 + 3 * 32) * 2  # layers x inflight(PP) x s b k ...
    dense = learner_ledger(SMALL, LearnerLayout(), 0.0).items
    assert "expert_weights" not in dense
    with pytest.raises(ValueError, match="expert parallel size 3"):
        learner_ledger(MOE, LearnerLayout(dp=3, ep=3), 0.0)


def test_the_plan_shows_the_steps_and_wall_time_the_token_budget_allows():
    """tiny_cpu: 16 prompts x 16 samples x at most 2 tokens = 256-512 tokens per step, 100 steps.
    A budget of 10 full steps allows 10-20 steps; one run.steps can never reach leaves run.steps;
    the wall time is the steps at the measured step time; dynamic sampling's discarded groups count."""
    from megatron_rl.plan_cli import plan_for_config, render
    from megatron_rl.train.config import load_train_config

    recipe = REPO / "configs/tiny_cpu.yaml"
    cfg = load_train_config(recipe, ["stop.max_generated_tokens=5120"])
    per_step = (cfg.samples_per_step, cfg.samples_per_step * cfg.rollout.max_tokens)
    plan = plan_for_config(cfg, step_seconds=3.0)
    length = plan["length"]
    assert length["tokens_per_step"] == list(per_step) == [256, 512]
    assert length["steps"] == [5120 // 512, 5120 // 256] and length["wall_s"] == [30.0, 60.0]
    assert "token budget 5120: 10-20 steps" in render(plan) and "the budget ends the run" in render(plan)
    unreachable = plan_for_config(load_train_config(recipe, ["stop.max_generated_tokens=10000000"]))["length"]
    assert unreachable["steps"] == [100, 100] and unreachable["wall_s"] is None
    assert "cannot end the run" in unreachable["note"]
    none = plan_for_config(load_train_config(recipe, []), step_seconds=2.0)["length"]
    assert none["steps"] == [100, 100] and none["wall_s"] == [200.0, 200.0]
    ds = plan_for_config(load_train_config(recipe, ["stop.max_generated_tokens=5120", "dynamic_sampling.enabled=true",
                                                    "dynamic_sampling.oversample=2", "dynamic_sampling.max_attempts=3"]))
    assert ds["length"]["tokens_per_step"] == [512, 3 * 512 * 2]  # 32 prompts drawn per attempt, 3 attempts
    assert ds["length"]["steps"] == [2, 10]
    with pytest.raises(ValueError, match="--step-seconds"):
        plan_for_config(cfg, step_seconds=0)


def test_sequence_parallel_splits_the_activations_over_tp_as_the_learner_runs_moe():
    """Korthikanti et al. eq. 4: with sequence parallelism a layer keeps s b h x 34/TP bytes (10 + 24/TP
    without), and the checkpointed layer inputs 2 s b h / TP; the planner turns it on where the learner
    does (MoE at TP > 1), and not for a dense model."""
    from megatron_rl.learner.config import uses_sequence_parallel
    from megatron_rl.plan_cli import plan_for_config
    from megatron_rl.train.config import load_train_config

    kw = dict(tp=2, pp=1, dp=2, ep=2, micro_batch_size=1, seq_length=16, reference_model=False)
    plain = learner_ledger(MOE, LearnerLayout(**kw), 0.0).items["activations"]
    sp = learner_ledger(MOE, LearnerLayout(sequence_parallel=True, **kw), 0.0).items["activations"]
    assert plain == 2 * 16 * 64 * (10 + 24 / 2) and sp == 2 * 16 * 64 * 34 / 2
    ckpt = learner_ledger(MOE, LearnerLayout(sequence_parallel=True, activation_checkpointing=True, **kw), 0.0)
    assert ckpt.items["activations"] == 2 * 2 * 16 * 64 / 2 + 16 * 64 * 34 / 2
    assert uses_sequence_parallel(True, 2) and not uses_sequence_parallel(True, 1)
    assert not uses_sequence_parallel(False, 4)
    recipe = REPO / "configs/qwen3_30b_a3b_24gpu_disaggregated.yaml"
    tp1, tp2 = (plan_for_config(load_train_config(recipe, [f"learner.tensor_parallel_size={tp}"]))
                for tp in (1, 2))
    # the recipe recomputes activations: with sequence parallelism at TP2 the kept layer inputs and the
    # one recomputed layer are both halved (without it, the kept inputs would stay whole)
    acts = [p["learner_gib_per_gpu"]["activations"] for p in (tp1, tp2)]
    assert acts[1] == pytest.approx(acts[0] / 2)


def test_every_verdict_names_its_reason_with_the_config_keys():
    """Issue 30, defect 3: "DOES NOT FIT" alone left the user guessing.  Each failed check is named
    (GPUs against cluster.gpus, a peak against cluster.gpu_memory_gib, the engine against its
    budget, the start-up rule), all of them when several fail; a fit says what it fits within."""
    lay = LearnerLayout(tp=2, pp=1, dp=4, activation_checkpointing=True)
    roll = RolloutLayout(tp=1, groups=8, max_num_seqs=64, max_model_len=2048)
    led, rled = learner_ledger(QWEN7B, lay, 0.15), rollout_ledger(QWEN7B, roll, 0.15)
    dis, col = compare_placements(led, rled, lay, roll, 80, 8, sleep_mode=True)
    assert not dis.fits and dis.reason == "16 GPUs needed, cluster.gpus is 8"  # memory alone would fit
    assert col.fits and col.reason.startswith("8 GPUs of cluster.gpus 8, peak ") and "cluster.gpu_memory_gib 80" in col.reason
    # A small GPU: every failing part named, with its number; too few GPUs as well.
    dis, col = compare_placements(led, rled, lay, roll, 24, 4, sleep_mode=True)
    assert dis.reason.startswith("16 GPUs needed, cluster.gpus is 4; the learner needs ")
    assert "more than cluster.gpu_memory_gib 24" in dis.reason
    assert col.reason.startswith("8 GPUs needed, cluster.gpus is 4; the ") and " phase needs " in col.reason
    # An engine over its own budget; a colocated layout that cannot start on GPUs.
    small = RolloutLayout(tp=1, groups=8, max_num_seqs=64, max_model_len=2048, gpu_memory_utilization=0.2)
    for v in compare_placements(led, rollout_ledger(QWEN7B, small, 0.15, 80), lay, small, 80, 16):
        assert "more than its budget" in v.reason and "rollout.gpu_memory_utilization" in v.reason, v.reason
    tp2 = RolloutLayout(tp=2, groups=4, max_num_seqs=16, max_model_len=2048, gpu_memory_utilization=0.3)
    col2 = compare_placements(led, rollout_ledger(QWEN7B, tp2, 0.15, 80), lay, tp2, 80, 16)[1]
    assert not col2.startable and col2.reason == col2.blocker


def test_plan_prints_the_reason_of_each_verdict(capsys):
    """The 7B colocated recipe: disaggregated needs 16 GPUs against cluster.gpus 8, said on its line."""
    from megatron_rl.cli import main

    assert main(["plan", "--config", str(REPO / "configs/qwen2_7b_8gpu_colocated.yaml")]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "GPUs, peak" in ln]
    assert len(lines) == 2, lines
    dis = next(ln for ln in lines if ln.strip().startswith("disaggregated"))
    assert "DOES NOT FIT (16 GPUs needed, cluster.gpus is 8)" in dis, dis
    col = next(ln for ln in lines if ln.strip().startswith("colocated"))
    assert "fits (8 GPUs of cluster.gpus 8, peak " in col, col


def test_resume_host_memory_of_the_7b_recipe_by_hand():
    """Issue 31, item 8: Megatron's distributed-optimizer load holds fp32 master + Adam m, v of the rank's
    whole TP x PP shard (12 B per stage parameter) on every rank, and again for each linear_fc1 parameter
    (the SwiGLU halves concatenated anew; measured in tests/dist/test_optimizer_checkpoint.py); the
    engines' rollback copies sit beside it."""
    from megatron_rl.plan_cli import plan_for_config
    from megatron_rl.train.config import load_train_config

    recipe = REPO / "configs/qwen2_7b_8gpu_colocated.yaml"
    cfg = load_train_config(recipe, [])
    plan = plan_for_config(cfg)
    lc, rc = cfg.learner, cfg.rollout
    p = plan["model_params"]
    ranks = min(8, lc.tensor_parallel_size * lc.pipeline_parallel_size * lc.data_parallel_size)
    fc1 = 28 * 2 * 3584 * 18944  # Qwen2.5-7B: layers x (gate + up) x hidden x intermediate, 3.8e9
    per_rank = (p + fc1) / (lc.tensor_parallel_size * lc.pipeline_parallel_size) * 12
    host = plan["resume_host_gib_per_node"]
    assert host["optimizer_load"] == pytest.approx(ranks * per_rank / GIB)
    assert per_rank / GIB == pytest.approx(11.4e9 / lc.tensor_parallel_size * 12 / GIB, rel=0.01)  # 32 GiB at TP4
    engines = min(8, rc.tensor_parallel_size * rc.data_parallel_size)
    assert host["rollback_copy"] == pytest.approx(engines * p / rc.tensor_parallel_size * 2 / GIB)  # bf16 engines
    assert host["total"] == pytest.approx(sum(v for k, v in host.items() if k != "total"))
    assert plan["host_memory_problem"] is None  # cluster.host_memory_gib unset: not checked

    small = plan_for_config(load_train_config(recipe, ["cluster.host_memory_gib=256"]))
    assert "cluster.host_memory_gib = 256" in small["host_memory_problem"]
    roomy = plan_for_config(load_train_config(recipe, ["cluster.host_memory_gib=1024"]))
    assert roomy["host_memory_problem"] is None


def test_plan_refuses_a_recipe_over_the_nodes_host_memory(capsys):
    from megatron_rl.cli import main

    recipe = str(REPO / "configs/qwen2_7b_8gpu_colocated.yaml")
    assert main(["plan", "--config", recipe, "cluster.host_memory_gib=1024"]) == 0
    assert main(["plan", "--config", recipe, "cluster.host_memory_gib=128"]) == 1
    assert "host memory per node at resume" in capsys.readouterr().out


def test_lora_counts_gradients_and_optimizer_state_of_the_adapters_alone():
    from megatron_rl.planner.ledger import adapter_params

    lay = LearnerLayout(tp=2, pp=1, dp=2, dtype="bf16", seq_length=16, ddp_bucket_params=1000,
                        training=AdapterTraining(rank=8, targets=("qkv", "proj", "fc1", "fc2")))
    # per layer and TP rank, x r = 8: qkv 64 + (4+2*2)*16/2 = 128; proj 4*16/2 + 64 = 96; fc1 64 + 2*128/2 = 192;
    # fc2 128/2 + 64 = 128 -> 544 x 8 x 2 layers
    a = 544 * 8 * 2
    assert adapter_params(SMALL, lay) == a
    items = learner_ledger(SMALL, lay, 0.0).items
    p_stage = SMALL.num_params / 2
    assert items["weights"] == (p_stage + a) * 2  # the frozen base and the adapters
    assert items["grads"] == a * 4 and items["master_weights"] == a * 4 / 2 and items["optimizer_states"] == a * 8 / 2
    assert items["comm_buffers"] == 2 * 1000 * 4  # a bucket of 1000 params; with fewer adapters, fewer
    small_bucket = learner_ledger(SMALL, LearnerLayout(training=AdapterTraining(rank=1, targets=("proj",)),
                                                      ddp_bucket_params=10**9),
                                  0.0).items
    assert small_bucket["comm_buffers"] == 2 * (64 + 64) * 2 * 4
    full = learner_ledger(SMALL, dataclasses.replace(lay, training=FULL), 0.0).items
    assert full["optimizer_states"] == p_stage * 8 / 2 and full["weights"] == p_stage * 2
    assert adapter_params(SMALL, LearnerLayout()) == 0


def test_lora_on_a_moe_model_freezes_the_experts():
    lay = LearnerLayout(tp=1, pp=2, dp=4, ep=4, seq_length=16,
                        training=AdapterTraining(rank=4, targets=("qkv", "proj")))
    items = learner_ledger(MOE, lay, 0.0).items
    assert items["expert_weights"] > 0
    assert items["expert_grads"] == items["expert_master_weights"] == items["expert_optimizer_states"] == 0


def test_the_plan_of_a_lora_run_trains_the_adapters_only(capsys):
    from megatron_rl.models.lora import LoraConfig
    from megatron_rl.plan_cli import plan_for_config, render
    from megatron_rl.train.config import load_train_config

    cfg = load_train_config(REPO / "configs/qwen2_1.5b_1gpu.yaml", [])
    full = plan_for_config(cfg)
    cfg.learner.lora = LoraConfig(enabled=True, rank=16, target_modules=["qkv", "proj", "fc1", "fc2"])
    lora = plan_for_config(cfg)
    assert full["lora"] is None and lora["lora"]["rank"] == 16
    a = lora["lora"]["adapter_params_per_gpu"]
    assert 0 < a < full["model_params"] / 50
    opt = lora["learner_gib_per_gpu"]["optimizer_states"] * GIB
    assert opt == pytest.approx(a * 8 / cfg.learner.data_parallel_size)
    assert lora["learner_gib_per_gpu"]["total"] < full["learner_gib_per_gpu"]["total"] / 2
    assert "LoRA: rank 16 on qkv, proj, fc1, fc2" in render(lora)
    host = lora["resume_host_gib_per_node"]["optimizer_load"]
    assert host < full["resume_host_gib_per_node"]["optimizer_load"] / 50


def test_a_lora_resume_loads_the_adapters_state_and_holds_fc1s_lora_b_twice():
    from megatron_rl.planner.host_memory import resume_host_memory

    def load(targets):
        lay = LearnerLayout(tp=2, pp=1, dp=2, training=AdapterTraining(rank=8, targets=targets))
        return resume_host_memory(SMALL, lay, RolloutLayout(), gpus_per_node=8, sleep_mode=False,
                                  rollback_copy=False).items["optimizer_load"]

    # 4 ranks x 12 B x (A_stage = 544 x 8 x 2, as above, + fc1's lora_B: 2 layers x 8 x 2 x 128 / TP 2 = 2048)
    assert load(("qkv", "proj", "fc1", "fc2")) == 4 * 12 * (544 * 8 * 2 + 2048)
    assert load(("qkv",)) == 4 * 12 * (128 * 8 * 2)  # no adapter on fc1: nothing of it is held twice
