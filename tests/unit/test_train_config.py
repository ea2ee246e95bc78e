"""Bad input to `megatron-rl train` is a clear error before any work starts (dry-run path).

Each case runs the real CLI entry point in-process with --dry-run: no Ray, vLLM or Megatron
is started, and the error message must name what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.cli import main

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny_cpu.yaml")


def dry_run(capsys, *overrides: str) -> tuple[int, str, str]:
    code = main(["train", "--config", TINY, "--dry-run", *overrides])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_valid_config_prints_the_plan(capsys, tmp_path):
    code, out, _ = dry_run(capsys, f"run.dir={tmp_path}")
    assert code == 0
    plan = json.loads(out)
    assert plan["mode"] == "sync" and plan["rollout"]["samples_per_step"] == 256
    assert plan["learner"]["global_batch"] == plan["coordinator"]["batch_size"] == 256
    assert plan["coordinator"]["max_staleness"] == 0
    assert plan["data"]["train"] == 800 and plan["resume_from"] is None
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


@pytest.mark.parametrize("override, needle", [
    ("learner.lr_typo=1", "learner.lr_typo"),                          # unknown key
    ("run.steps=many", "run.steps"),                                    # wrong type
    ("learner.tensor_parallel_size=3", "tensor parallel size 3"),      # 4 heads / 3
    ("learner.pipeline_parallel_size=3", "pipeline parallel size 3"),  # 2 layers / 3
    ("learner.micro_batch_size=48", "learner.micro_batch_size"),        # 16 x 16 = 256 is not a multiple of 48
    ("run.mode=async", None),                                           # async with its default bound: valid
    ("rollout.tensor_parallel_size=3", "rollout.tensor_parallel_size"),
    ("rollout.weight_transfer=nccl", "run.placement 'disaggregated'"),  # NCCL: no two ranks on one GPU
    ("rollout.weight_transfer=none", "could never reach the rollout engines"),
    ("dynamic_sampling.oversample=0.5", "dynamic_sampling.oversample"),
    ("model.init_from=runs/x", "exactly one of model.path"),                     # with model.tiny set
])
def test_bad_config_is_named(capsys, override, needle, tmp_path):
    code, _, err = dry_run(capsys, override, f"run.dir={tmp_path}")
    if needle is None:
        assert code == 0, err
        return
    assert code == 2
    assert needle in err, err


@pytest.mark.parametrize("override, needles", [
    # derived keys: refused, naming the key and what to write instead
    ("learner.global_batch_size=256", ["learner.global_batch_size", "run.prompts_per_step x run.group_size"]),
    ("coordinator.batch_size=256", ["coordinator.batch_size", "run.prompts_per_step x run.group_size"]),
    ("coordinator.wal_path=/tmp/q.db", ["coordinator.wal_path", "RUN_DIR/queue.db"]),
    ("rollout.model=/tmp/m", ["rollout.model", "model.path"]),
    # the staleness bound comes from run.mode; only async may override it
    ("coordinator.max_staleness=0", ["coordinator.max_staleness", "run.mode 'sync'", "run.mode=async"]),
    # one spelling of parallel sizes: the old ones name the new key
    ("learner.tensor_model_parallel_size=1", ["learner.tensor_model_parallel_size", "learner.tensor_parallel_size"]),
    ("learner.pipeline_model_parallel_size=1", ["learner.pipeline_parallel_size"]),
    ("run.learner_data_parallel_size=1", ["run.learner_data_parallel_size", "learner.data_parallel_size"]),
    ("run.rollout_groups=2", ["run.rollout_groups", "rollout.data_parallel_size"]),
])
def test_derived_and_renamed_keys_are_refused_with_what_to_use(capsys, override, needles):
    code, _, err = dry_run(capsys, override)
    assert code == 2
    for needle in needles:
        assert needle in err, err


def test_batch_and_staleness_are_derived_once():
    from megatron_rl.train.config import load_train_config

    cfg = load_train_config(TINY, ["run.prompts_per_step=4", "run.group_size=8", "learner.micro_batch_size=8"])
    assert cfg.learner.global_batch_size == cfg.coordinator.batch_size == 32
    bounds = {mode: load_train_config(TINY, [f"run.mode={mode}"]).coordinator
              for mode in ("sync", "one_step_off", "async")}
    assert [(c.max_staleness, c.max_version_lag) for c in bounds.values()] == [(0, 1), (1, 1), (2, 2)]
    async3 = load_train_config(TINY, ["run.mode=async", "coordinator.max_staleness=3"]).coordinator
    assert (async3.max_staleness, async3.max_version_lag) == (3, 3)
    with pytest.raises(ValueError, match="coordinator.max_version_lag"):
        load_train_config(TINY, ["run.mode=async", "coordinator.max_staleness=3", "coordinator.max_version_lag=2"])
    with pytest.raises(ValueError, match="coordinator.max_staleness must be an int >= 1"):
        load_train_config(TINY, ["run.mode=async", "coordinator.max_staleness=0"])


def test_sft_first_and_init_from_are_one_choice(capsys):
    code, _, err = dry_run(capsys, "sft.first=true", "model.tiny=null", "model.init_from=runs/sft")
    assert code == 2
    assert "sft.first" in err and "model.init_from" in err, err


def test_dataset_missing_field_is_named(capsys, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n" + json.dumps({"question": "2+2"}) + "\n")
    code, _, err = dry_run(capsys, "data.task=jsonl", f"data.train_file={data}")
    assert code == 2
    assert "train.jsonl:2" in err and "answer" in err, err


def test_checkpoint_from_another_tokenizer_is_refused(capsys, tmp_path):
    from megatron_rl.checkpoint import save_checkpoint
    from megatron_rl.models.tiny import make_tiny_model

    make_tiny_model(tmp_path / "model", arch="llama", size="tiny")
    save_checkpoint(tmp_path / "checkpoints", 5, policy_version=5, config_hash="x",
                    save_fn=lambda d: (d / "weights").mkdir(), tokenizer_hash="f" * 64)
    code, _, err = dry_run(capsys, f"run.dir={tmp_path}")
    assert code == 2
    assert "refusing to resume across tokenizers" in err, err


def test_planner_reports_a_layout_that_cannot_fit(capsys):
    recipe = str(REPO / "configs" / "qwen2_7b_8gpu_colocated.yaml")
    assert main(["plan", "--config", recipe, "--json"]) == 0
    fits = json.loads(capsys.readouterr().out)
    assert next(p for p in fits["placements"] if p["placement"] == "colocated")["fits"]
    assert main(["plan", "--config", recipe, "--json", "cluster.gpu_memory_gib=24"]) == 1
    small = json.loads(capsys.readouterr().out)
    col = next(p for p in small["placements"] if p["placement"] == "colocated")
    # TP4 learner shards; the whole 7.6 B model in bf16 is the largest item, held twice per GPU: by the
    # TP1 engine and by the ipc transport's staging copy of the publication (equal sizes).
    assert not col["fits"] and col["largest_item"] in ("rollout/weights", "learner/publish_staging")


def test_qwen3_8b_recipe_is_planned_from_its_config(capsys):
    """The Qwen3-8B recipe's architecture file is read (head_dim 128, untied) and its layout fits 8 x 80 GiB."""
    recipe = str(REPO / "configs" / "qwen3_8b_8gpu_colocated.yaml")
    assert main(["plan", "--config", recipe, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert abs(plan["model_params"] / 1e9 - 8.19) < 0.01  # Qwen3-8B: 8.2B, 6.95B without embeddings
    assert next(p for p in plan["placements"] if p["placement"] == "colocated")["fits"]
    # Its former layout (rollout TP2 x 4 groups, learner TP4 x DP2) cannot start colocated on GPUs.
    old = ["rollout.tensor_parallel_size=2", "rollout.data_parallel_size=4",
           "learner.tensor_parallel_size=4", "learner.data_parallel_size=2"]
    assert main(["plan", "--config", recipe, "--json", *old]) == 1
    col = next(p for p in json.loads(capsys.readouterr().out)["placements"] if p["placement"] == "colocated")
    assert not col["startable"] and not col["fits"] and "rollout.tensor_parallel_size" in col["blocker"]


def _write_jsonl(path, questions):
    path.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in questions))
    return path


def test_jsonl_held_out_splits_are_carved_disjoint(capsys, tmp_path):
    data = _write_jsonl(tmp_path / "train.jsonl", [f"{i}+0" for i in range(40)])
    code, out, err = dry_run(capsys, f"run.dir={tmp_path / 'run'}", "data.task=jsonl", f"data.train_file={data}")
    assert code == 0, err
    sizes = json.loads(out)["data"]
    assert (sizes["train"], sizes["dev"], sizes["test"]) == (32, 4, 4)  # was 40/40/40: held-out = training data


def test_jsonl_test_file_sharing_training_questions_is_refused(capsys, tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", [f"{i}+0" for i in range(40)])
    test = _write_jsonl(tmp_path / "test.jsonl", ["100+0", "7+0", "101+0"])
    code, _, err = dry_run(capsys, f"run.dir={tmp_path / 'run'}", "data.task=jsonl", f"data.train_file={train}",
                           f"data.test_file={test}")
    assert code == 2
    assert "1 question(s) appear in more than one split" in err and "'7+0'" in err and "test (id 2)" in err, err


def test_qwen3_30b_a3b_recipe_is_planned_with_experts(capsys):
    """The Qwen3-30B-A3B recipe: 30.5 B parameters (3.3 B active), experts EP-sharded; fits 24 x 80 GiB
    disaggregated, and without expert parallelism the experts' optimizer state alone breaks it."""
    recipe = str(REPO / "configs" / "qwen3_30b_a3b_24gpu_disaggregated.yaml")
    assert main(["plan", "--config", recipe, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert abs(plan["model_params"] / 1e9 - 30.53) < 0.01 and abs(plan["model_active_params"] / 1e9 - 3.35) < 0.01
    assert plan["learner_gib_per_gpu"]["expert_optimizer_states"] > plan["learner_gib_per_gpu"]["optimizer_states"]
    assert next(p for p in plan["placements"] if p["placement"] == "disaggregated")["fits"]
    assert main(["plan", "--config", recipe, "--json", "learner.expert_parallel_size=1"]) == 1
    capsys.readouterr()


def test_max_tokens_per_micro_batch_zero_is_off_and_the_dry_run_says_so(capsys, tmp_path):
    """Issue 30, defect 5: `learner.max_tokens_per_micro_batch=0` was accepted without a word.  0 is the
    code's "off" (as rollout.top_k 0 and learner.clip_grad 0): the same micro-batches as null, and the
    dry run names the layout it will use; a negative budget is refused naming the key and what 0 means."""
    from megatron_rl.learner.micro_batches import plan_micro_batches

    lengths = [5, 9, 3, 7]
    assert plan_micro_batches(lengths, dp=2, micro_batch_size=1, max_tokens=0) == \
        plan_micro_batches(lengths, dp=2, micro_batch_size=1, max_tokens=None)
    layouts = {}
    for value in ("0", "null", "512"):
        code, out, err = dry_run(capsys, f"run.dir={tmp_path}", f"learner.max_tokens_per_micro_batch={value}")
        assert code == 0, err
        layouts[value] = json.loads(out)["learner"]["micro_batches"]
    assert layouts["0"].startswith("fixed: ") and "learner.max_tokens_per_micro_batch 0 means off" in layouts["0"]
    assert layouts["null"].startswith("fixed: ") and "max_tokens_per_micro_batch null means off" in layouts["null"]
    assert layouts["512"].startswith("token budget: ") and "at most 512 tokens" in layouts["512"]
    code, _, err = dry_run(capsys, f"run.dir={tmp_path}", "learner.max_tokens_per_micro_batch=-1")
    assert code == 2 and "learner.max_tokens_per_micro_batch" in err and "0 or null (off" in err, err


def test_a_float_in_exponent_form_is_the_number_it_spells():
    """YAML 1.1 reads `1e-6` (no dot) as text; a float field takes the number, from a file and an override alike,
    while text that is no number is still refused by name."""
    import yaml

    from megatron_rl.config import ConfigProblems
    from megatron_rl.train.config import load_train_config

    base = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    assert yaml.safe_load("x: 3e-4")["x"] == "3e-4"  # the trap itself
    cfg = load_train_config(str(base), ["learner.lr=3e-4", "loss.kl_control=adaptive", "loss.kl_target=1E-6"])
    assert (cfg.learner.lr, cfg.loss.kl_target) == (3e-4, 1e-6)
    for bad in ("3e", "1e-6x", "nan", "e5"):
        with pytest.raises(ConfigProblems, match=r"learner\.lr: expected float, got str"):
            load_train_config(str(base), [f"learner.lr={bad}"])


def test_tiny_tie_embeddings_makes_a_tied_model(tmp_path):
    from safetensors import safe_open

    from megatron_rl.train.config import ModelConfig, TinyModelSpec
    from megatron_rl.train.start_model import prepare_model

    path = prepare_model(ModelConfig(tiny=TinyModelSpec(arch="qwen2", tie_embeddings=True)), tmp_path)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
