"""The engine side of an adapter-only publication (a LoRA run): each policy version is a LoRA adapter.

    kwargs.update(adapter_engine_options(serving))          # vllm.LLM(..., enable_lora=True, max_loras=...)
    llm.collective_rpc("megatron_rl_serve_adapters", args=(adapter_spec(serving, model_dir),))
    llm.generate(prompts, params, lora_request=adapter_request(version))   # None for version 0

A LoRA run's engines load the frozen base once, from disk, and never change it.  Each publication
carries only the adapters (publish/adapter_source.py), through the same checked path as full weights:
staged, verified bucket by bucket, checked to be exactly the adapter's tensors (names and shapes from
`adapter_shapes`), and only then installed -- by `AdapterStore.install`, from the staged tensors in memory,
as vLLM LoRA adapter `version + 1` (vLLM's ids start at 1).  Nothing goes through a disk.

The engine keeps the adapters of the last `versions` policy versions (plus the one being installed): a request names its adapter
(`adapter_request`) and keeps it to its end, whatever is published meanwhile, as long as its version
stays admissible.  A failed install or refit check drops only the new adapter; the ones before still
serve.  Version 0 of a LoRA run is its base (every B starts at zero), served with no adapter until the
first publication installs one.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable


SERVING_KEYS = {"rank", "alpha", "target_modules", "versions"}
"""What RolloutConfig.adapter holds (models/lora_config.py LoraConfig.serving)."""


def serving_problem(serving: dict[str, Any] | None, *, sleep_mode: bool | None) -> str | None:
    """What is wrong with RolloutConfig.adapter `serving` beside rollout.sleep_mode; None when nothing (a
    full-weights run's None included)."""
    if serving is None:
        return None
    if set(serving) != SERVING_KEYS:
        return f"rollout.adapter needs exactly rank, alpha, target_modules and versions, got {sorted(serving)}"
    if sleep_mode:
        return ("learner.lora.enabled with rollout.sleep_mode: a sleeping engine drops the adapters it keeps; use "
                "rollout.sleep_mode false")
    return None


def sleep_blocked(serving: dict[str, Any] | None) -> str | None:
    """Why engines serving `serving` (RolloutConfig.adapter) may not sleep (rollout/sleep.py choose_sleep);
    None for full weights."""
    return None if serving is None else "a LoRA run's engines keep their adapters awake (learner.lora.enabled)"


def kept_base(serving: dict[str, Any] | None, model: str) -> str | None:
    """The base an engine handed from run to run must have loaded (rollout/engine_setup.py engine_identity): a LoRA
    run publishes only adapters, so its engines keep `model`; None for full weights (every version is published)."""
    return None if serving is None else model


def adapter_engine_options(serving: dict[str, Any] | None) -> dict[str, Any]:
    """vllm.LLM keyword arguments of an engine serving `serving` (RolloutConfig.adapter): LoRA on, one
    slot per kept version, and one for a version being installed, in a batch and in the adapter cache;
    none for full weights (None)."""
    from megatron_rl.models.lora_config import VLLM_LORA_RANKS  # the config refuses a larger rank (LoraConfig)

    if serving is None:
        return {}
    rank = int(serving["rank"])
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"learner.lora.rank {rank}: vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]}")
    slots = int(serving["versions"]) + 1
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": slots, "max_cpu_loras": slots}


def adapter_spec(serving: dict[str, Any], model_dir: str) -> dict[str, Any]:
    """What each engine worker needs to check and install adapters: the PEFT config, every tensor's
    shape (from the base's config.json) and how many versions to keep."""
    from megatron_rl.conversion.lora_export import peft_config
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.models.lora_checkpoint import lora_config_of
    from megatron_rl.publish.adapter_source import adapter_shapes

    lora = lora_config_of(serving)
    shapes = adapter_shapes(lora, load_hf_config(model_dir))
    return {"peft_config": peft_config(lora, model_dir), "versions": int(serving["versions"]),
            "shapes": {name: list(shape) for name, shape in shapes.items()}}


def adapter_request(version: int | None, installed: bool = True):
    """vLLM's LoRARequest naming policy `version`'s adapter, or None (the base: version 0, whose adapters
    are all zero, never published).  The path is a label only: the adapter is installed from memory."""
    if version is None or int(version) == 0 or not installed:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"policy-v{version}", int(version) + 1, f"megatron-rl:policy/v{version}")


class FollowsRefits:
    """What a full-weights run's request keeps to its end: nothing, it follows every refit.  Its tokens carry the
    versions the engine labelled them with, its KV the epochs the refits left (rollout/stream_engine.py)."""

    lora_request = None

    def spans(self, weight_versions: list | None, num_tokens: int) -> list | None:
        return weight_versions

    def kv_epoch(self, flight_epoch: dict[int, int]) -> dict[int, int]:
        return flight_epoch


class KeepsAdapter:
    """What a LoRA run's request keeps to its end: committed `label`'s adapter (`lora_request`, None for the base
    before any adapter).  The base never changes, so every token is that label's version and the request's KV
    is its own adapter's (vLLM keys cached blocks by adapter) whatever is published meanwhile."""

    def __init__(self, lora_request: Any, label: str):
        self.lora_request, self.label = lora_request, label

    def spans(self, weight_versions: list | None, num_tokens: int) -> list:
        return [SimpleNamespace(version=self.label, start=0, end=num_tokens)] if num_tokens else []

    def kv_epoch(self, flight_epoch: dict[int, int]) -> dict[int, int]:
        version = int(self.label.split(":", 1)[0])
        return {version: version}


FOLLOWS_REFITS = FollowsRefits()


class ServedAdapters:
    """The rollout actor's side (rollout/worker.py): which versions' adapters its engine serves, and the
    LoRARequest each request names.  Inactive (every request None) when the run publishes full weights."""

    def __init__(self, serving: dict[str, Any] | None):
        self.serving = serving  # RolloutConfig.adapter
        self.versions: set[int] = set()  # committed versions whose adapters the engine keeps

    def start(self, llm, model_dir: str) -> None:
        """Tell every worker of the engine (`llm`: vllm.LLM or its stand-in) that versions are adapters."""
        if self.serving is not None:
            llm.collective_rpc("megatron_rl_serve_adapters", args=(adapter_spec(self.serving, model_dir),))

    def request(self, version: int | None, installed: bool = False):
        """The LoRARequest of `version`'s adapter; None for the base (version 0 before any adapter) or when
        inactive.  `installed`: on the engine though not committed yet (a refit check scores it)."""
        if self.serving is None:
            return None
        return adapter_request(version, installed or version in self.versions)

    def committed(self, version: int) -> None:
        """`version`'s adapter serves; the engine keeps the newest serving["versions"] of them."""
        if self.serving is not None:
            self.versions = set(sorted(self.versions | {int(version)})[-int(self.serving["versions"]):])

    def session_calls(self) -> tuple[str, ...]:
        """The engine workers' calls that must follow every weight update session: vLLM empties its adapter cache
        there, so a LoRA run's workers put the kept adapters back; none when the run publishes full weights."""
        return ("megatron_rl_restore_adapters",) if self.serving is not None else ()

    def session_closed(self, llm) -> None:
        """After every weight update session (`llm`: vllm.LLM or its stand-in): session_calls on every worker."""
        for call in self.session_calls():
            llm.collective_rpc(call)

    def keeps(self, label: str, version_of: Callable[[str], int]) -> FollowsRefits | KeepsAdapter:
        """What a request admitted now keeps to its end: committed `label`'s adapter, or (full weights) nothing."""
        if self.serving is None:
            return FOLLOWS_REFITS
        return KeepsAdapter(self.request(version_of(label)), label)


class AdapterStore:
    """The adapters one vLLM worker serves, one per policy version, oldest evicted first: a LoRA run's kind of
    weights on an engine worker (its sibling, a full-weights run's: publish/vllm_reload.py FullWeights; both answer
    shapes / install / keep / roll_back / restore)."""

    def __init__(self, lora_manager, spec: dict[str, Any]):
        """`lora_manager`: the worker's vLLM WorkerLoRAManager (model_runner.lora_manager); `spec`: adapter_spec's."""
        if lora_manager is None:
            raise RuntimeError("this engine was started without LoRA (enable_lora): it cannot serve adapters")
        self.manager = lora_manager
        self.peft_config = dict(spec["peft_config"])
        self.versions = int(spec["versions"])
        self.shapes = {name: tuple(shape) for name, shape in spec["shapes"].items()}
        self.models: dict[int, Any] = {}  # policy version -> vLLM LoRAModel (host memory), oldest first
        _base_head(lora_manager._adapter_manager.model)

    def install(self, version: int, tensors) -> None:
        """Build adapter `version` from (PEFT name, tensor) pairs and make it servable beside the newest
        `versions` ones (older ones are evicted).  Raises (and installs nothing) on bad tensors."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        helper = PEFTHelper.from_dict(self.peft_config)
        helper.validate_legal(self.manager.lora_config)
        model = self.manager._adapter_manager.model  # vLLM has no public way to add an adapter from memory
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        adapter = LoRAModel.from_lora_tensors(
            # Copies: the staged tensors are views of the staging buffers the next publication is received into.
            int(version) + 1, {name: t.clone() for name, t in tensors}, helper, device="cpu",
            dtype=self.manager.lora_config.lora_dtype, model_vocab_size=self.manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        self.remove(version)  # the same version published again (after a refused refit check)
        while len(self.models) > self.versions:
            self.remove(next(iter(self.models)))
        self.models[int(version)] = adapter
        self.restore()

    def restore(self) -> None:
        """Put every kept adapter back into vLLM's cache.  vLLM empties that cache at the end of every weight
        update session (its worker's finish_weight_update: "base weights replaced"), though a LoRA run's
        base never changes: the worker calls this right after each session (megatron_rl_restore_adapters)."""
        cache = self.manager._adapter_manager
        for adapter in self.models.values():
            if adapter.id not in cache.list_adapters():
                cache.add_adapter(adapter)

    def keep(self, loaded, keep_copy: bool) -> None:
        """The group accepted the newest adapter: nothing to copy (the newest `versions` adapters stay kept)."""

    def roll_back(self, version: int, feed) -> None:
        """Adapter `version` failed to load somewhere in the group: drop it (the ones before it were never
        unloaded); `feed` is not needed (FullWeights reload through it)."""
        self.remove(version)

    def remove(self, version: int) -> None:
        """Stop serving `version`'s adapter (no-op when it is not kept)."""
        if self.models.pop(int(version), None) is not None:
            self.manager.remove_adapter(int(version) + 1)

    @property
    def installed(self) -> list[int]:
        """The versions whose adapters this worker keeps, oldest first."""
        return list(self.models)


def _base_head(model) -> None:
    """Compute the logits with the base output layer, never an adapter's: our adapters sit on the linear
    layers of transformer layers only (peft target modules), so the result is the same, and vLLM 0.32's
    LoRA logits path on CPU (punica_cpu add_lora_logits) indexes by request, not by row, and fails on
    prompt logprobs -- which the refit check and `megatron-rl reconcile` score with."""
    from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA

    for module in model.modules():
        if isinstance(module, LogitsProcessorWithLoRA):
            base = module.base_layer

            def logits(hidden_states, lm_head, embedding_bias=None, skip_gather=False, _base=base):
                return _base._get_logits(hidden_states, getattr(lm_head, "base_layer", lm_head), embedding_bias,
                                         skip_gather)

            module._get_logits = logits
