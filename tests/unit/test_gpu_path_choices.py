"""The publication transport and vLLM sleep mode, chosen once at start-up (issue 18).

    python -m pytest tests/unit/test_gpu_path_choices.py -q

Transport from (placement, device): cpu -> gloo, colocated + cuda -> ipc, disaggregated + cuda ->
nccl; a setting that contradicts the placement or the device is a ConfigError naming
rollout.weight_transfer.  Sleep mode: on only colocated on GPUs in sync mode; on CPU it is off
because vLLM 0.32's CPU platform has none (checked against the installed vLLM below).
"""

from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.publish.transport import choose_transport
from megatron_rl.models.lora_config import LoraConfig
from megatron_rl.rollout.sleep import choose_sleep

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("placement, device, chosen", [
    ("colocated", "cpu", "gloo"), ("disaggregated", "cpu", "gloo"),
    ("colocated", "cuda", "ipc"), ("disaggregated", "cuda", "nccl"),
])
def test_auto_follows_placement_and_device(placement, device, chosen):
    assert choose_transport(placement, device) == chosen
    assert choose_transport(placement, device, "auto") == chosen


@pytest.mark.parametrize("placement, device", [("colocated", "cpu"), ("colocated", "cuda"),
                                               ("disaggregated", "cpu"), ("disaggregated", "cuda")])
def test_gloo_is_allowed_everywhere(placement, device):
    assert choose_transport(placement, device, "gloo") == "gloo"


@pytest.mark.parametrize("placement, device, requested, says", [
    ("colocated", "cuda", "nccl", "needs run.placement 'disaggregated'"),
    ("disaggregated", "cuda", "ipc", "needs run.placement 'colocated'"),
    ("colocated", "cpu", "ipc", "needs CUDA"),
    ("disaggregated", "cpu", "nccl", "needs CUDA"),
])
def test_contradicting_override_is_a_config_error_naming_the_field(placement, device, requested, says):
    with pytest.raises(ConfigError) as err:
        choose_transport(placement, device, requested)
    assert str(err.value).startswith(f"rollout.weight_transfer '{requested}'") and says in str(err.value)


@pytest.mark.parametrize("overrides, says", [
    (["rollout.weight_transfer=ipc", "run.placement=disaggregated"], "rollout.weight_transfer 'ipc' needs "
                                                                     "run.placement 'colocated'"),
    (["rollout.weight_transfer=nccl"], "rollout.weight_transfer 'nccl' needs run.placement 'disaggregated'"),
])
def test_placement_contradiction_is_refused_with_the_config(overrides, says):
    """The placement part needs no device: it is refused before anything starts."""
    from megatron_rl.train.config import load_train_config

    with pytest.raises(ConfigError, match=says):
        load_train_config(REPO / "configs/tiny_cpu.yaml", overrides)


@pytest.mark.parametrize("overrides, says", [
    (["run.mode=one_step_off"], "run.mode 'one_step_off' generates while the learner learns"),
    (["run.mode=async"], "run.mode 'async' generates while the learner learns"),
    (["run.placement=disaggregated"], "run.placement 'disaggregated'"),
])
def test_sleep_mode_true_outside_colocated_sync_is_refused_with_the_config(overrides, says):
    """rollout.sleep_mode true in one_step_off/async (or disaggregated) can work on no device: it is
    refused when the config is loaded, naming the field and the reason, not at start-up on a GPU."""
    from megatron_rl.train.config import load_train_config

    with pytest.raises(ConfigError) as err:
        load_train_config(REPO / "configs/tiny_cpu.yaml", ["rollout.sleep_mode=true", *overrides])
    assert str(err.value).startswith("rollout.sleep_mode true cannot work here") and says in str(err.value)
    # unset or false is fine there, and true in sync mode waits for the device check at start-up
    load_train_config(REPO / "configs/tiny_cpu.yaml", ["rollout.sleep_mode=false", *overrides])
    load_train_config(REPO / "configs/tiny_cpu.yaml", overrides)
    assert load_train_config(REPO / "configs/tiny_cpu.yaml", ["rollout.sleep_mode=true"]).rollout.sleep_mode


def test_start_up_choice_uses_the_run_config():
    from megatron_rl.train.config import load_train_config
    from megatron_rl.train.placement import gpu_path_choices

    cfg = load_train_config(REPO / "configs/tiny_cpu.yaml", [])
    assert cfg.rollout.weight_transfer == "auto" and cfg.rollout.sleep_mode is None
    transport, sleeps, why = gpu_path_choices(cfg, "cpu")
    assert (transport, sleeps) == ("gloo", False) and "CPU platform has no sleep mode" in why
    ipc = load_train_config(REPO / "configs/tiny_cpu.yaml", ["rollout.weight_transfer=ipc"])
    with pytest.raises(ConfigError, match="rollout.weight_transfer 'ipc' needs CUDA"):
        gpu_path_choices(ipc, "cpu")
    sync_gpu = SimpleNamespace(run=SimpleNamespace(placement="colocated", mode="sync"),
                               rollout=SimpleNamespace(weight_transfer="auto", sleep_mode=None),
                               rollout_served=SimpleNamespace(adapter=None))  # TrainConfig.rollout_served
    assert gpu_path_choices(sync_gpu, "cuda")[:2] == ("ipc", True)
    sync_gpu.rollout_served.adapter = LoraConfig(enabled=True).serving(2)  # a LoRA run's engines keep their adapters
    transport, sleeps, why = gpu_path_choices(sync_gpu, "cuda")
    assert (transport, sleeps) == ("ipc", False) and "learner.lora.enabled" in why


@pytest.mark.parametrize("placement, device, mode, on, says", [
    ("colocated", "cuda", "sync", True, "engines sleep while the learner learns"),
    ("colocated", "cuda", "one_step_off", False, "generates while the learner learns"),
    ("colocated", "cuda", "async", False, "generates while the learner learns"),
    ("disaggregated", "cuda", "sync", False, "GPUs of their own"),
    ("colocated", "cpu", "sync", False, "CPU platform has no sleep mode"),
])
def test_sleep_mode_auto(placement, device, mode, on, says):
    got, why = choose_sleep(placement=placement, device=device, mode=mode)
    assert got is on and says in why


def test_sleep_mode_asked_for_where_it_cannot_work_names_the_field():
    assert choose_sleep(placement="colocated", device="cuda", mode="sync", requested=True)[0] is True
    for kw in (dict(device="cpu", mode="sync"), dict(device="cuda", mode="one_step_off")):
        with pytest.raises(ConfigError, match="rollout.sleep_mode true cannot work here"):
            choose_sleep(placement="colocated", requested=True, **kw)
    assert choose_sleep(placement="colocated", device="cuda", mode="sync", requested=False) == (
        False, "rollout.sleep_mode is false")


def test_installed_vllm_cpu_platform_has_no_sleep_mode():
    """What the CPU reason states, read off the installed vLLM: its CPU platform reports no sleep
    mode (so enable_sleep_mode would be refused by ModelConfig), while CUDA's does."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import Platform, PlatformEnum

    class CudaLike(Platform):  # vllm.platforms.cuda needs the CUDA build; the rule lives in the interface
        _enum = PlatformEnum.CUDA

    assert CpuPlatform().is_sleep_mode_available() is False
    assert CudaLike().is_sleep_mode_available() is True


def test_engine_arguments_follow_the_choices(tmp_path):
    from megatron_rl.publish.vllm_engine import BACKEND, IPC_BACKEND, NCCL_BACKEND
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.engine_setup import engine_env, llm_kwargs

    def kwargs(**kw):
        return llm_kwargs(RolloutConfig(model=str(tmp_path), **kw), on_gpu=True)

    assert kwargs(weight_transfer="ipc", sleep_mode=True)["weight_transfer_config"] == {"backend": IPC_BACKEND}
    assert kwargs(weight_transfer="ipc", sleep_mode=True)["enable_sleep_mode"] is True
    assert kwargs(weight_transfer="nccl")["weight_transfer_config"] == {"backend": NCCL_BACKEND}
    assert kwargs()["weight_transfer_config"] == {"backend": BACKEND}  # standalone "auto": gloo
    assert "enable_sleep_mode" not in kwargs(sleep_mode=False) and "enable_sleep_mode" not in kwargs()
    assert "weight_transfer_config" not in kwargs(weight_transfer="none")
    assert engine_env(RolloutConfig(model=str(tmp_path), weight_transfer="ipc"), on_gpu=True) == {
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def test_an_eager_cpu_engine_does_not_trace_its_sampler():
    """CPU engines run eager (llm_kwargs), yet vLLM's sampler keeps one torch.compile'd op that dynamo traces at
    the first generate (2.7 s an engine start here): engine_env turns dynamo off for them, and only them."""
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.engine_setup import engine_env, llm_kwargs

    cpu = RolloutConfig()
    assert llm_kwargs(cpu, on_gpu=False)["enforce_eager"] is True
    assert engine_env(cpu, on_gpu=False)["TORCHDYNAMO_DISABLE"] == "1"
    compiled = RolloutConfig(engine_options={"enforce_eager": False})  # a user who wants vLLM's compilation
    assert "TORCHDYNAMO_DISABLE" not in engine_env(compiled, on_gpu=False)
    assert "TORCHDYNAMO_DISABLE" not in engine_env(cpu, on_gpu=True)
