"""vLLM weight-transfer backend "megatron_rl_gloo": receive checked publications on CPU.

(Its GPU siblings "megatron_rl_nccl" (publish/vllm_nccl.py) and "megatron_rl_ipc"
(publish/vllm_ipc.py) share the staging and all-or-nothing commit below, VerifiedCommit, and
differ only in how bytes arrive: the three backends of publish/transports.py.)

Loaded inside vLLM's worker processes, either by the general-plugin entry point

    [vllm.general_plugins] megatron_rl_gloo = megatron_rl.publish.vllm_engine:register

or by naming `PublicationWorkerExtension` as vLLM's `worker_extension_cls` (importing this
module registers the backend; RolloutWorker does both).  Then, through the LLM object:

    llm.init_weight_transfer_engine({"init_info": {"master_address": ..., "master_port": ...,
                                                   "rank_offset": 1, "world_size": 3}})
    llm.start_weight_update(); llm.update_weights({"update_info": {"version": 4}})
    status = llm.collective_rpc("megatron_rl_publication_status")   # one dict per worker
    if not all ok: llm.collective_rpc("megatron_rl_drop_publication")  # all-or-nothing
    llm.finish_weight_update()      # commits only if this worker verified every bucket

`update_weights` receives the whole publication (wire.receive_publication) into staging
buffers, verifies every bucket and checks that it holds exactly the model's tensors (names
and shapes from the model's config.json through the shared mapping: nothing missing, nothing
extra) in the dtype the engine serves (the trainer casts once, the checksums cover those bytes,
a mismatch is refused rather than cast on load); nothing touches the model yet.  `finish_weight_update`
loads the staged tensors through vLLM's layerwise reload only when all of them verified;
otherwise it drops them, and the model keeps serving the previous version.  A refusal is
reported (bucket index and tensor names) through `megatron_rl_publication_status`, never
raised inside the engine process, so the engine stays up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl.publish.manifest import dtype_name
from megatron_rl.publish.transports import GlooTransport, IpcTransport, NcclTransport, release_gloo_group
from megatron_rl.publish.vllm_reload import FullWeights
from megatron_rl.publish.wire import ReceivedPublication, StagingBuffers, open_group, receive_publication

log = logging.getLogger(__name__)

BACKEND = GlooTransport.vllm_backend
NCCL_BACKEND = NcclTransport.vllm_backend  # vLLM's NCCL transfer + our manifest check (publish/vllm_nccl.py)
IPC_BACKEND = IpcTransport.vllm_backend  # vLLM's CUDA IPC handles + our manifest check (publish/vllm_ipc.py)


def enable_cpu_amx() -> None:
    """Ask Linux for AMX tile permission in this process (CPU only; harmless elsewhere).

    vLLM worker processes started with "spawn" (always, inside Ray actors) otherwise die
    with SIGILL in the CPU attention kernels on AMX machines: the permission is per
    process and only inherited through fork.
    """
    if not torch.cuda.is_available() and hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()


def register() -> None:
    """Register our backends with vLLM's factory (idempotent: plugins load repeatedly).
    The NCCL and IPC ones are imported only when an engine asks for them."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    enable_cpu_amx()
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")
    if NCCL_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(NCCL_BACKEND, "megatron_rl.publish.vllm_nccl",
                                                    "CheckedNCCLWeightTransferEngine")
    if IPC_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(IPC_BACKEND, "megatron_rl.publish.vllm_ipc",
                                                    "CheckedIPCWeightTransferEngine")


def expected_tensors(model_dir: str) -> dict[str, tuple[int, ...]] | None:
    """HF name -> shape of every tensor a publication to this model must hold, from its
    config.json through the shared conversion mapping; None (and a warning) for a model the
    mapping does not cover, whose publications are then checked by checksums only."""
    from megatron_rl.conversion.mapping import hf_shapes
    from megatron_rl.models.hf_config import load_hf_config

    try:
        return hf_shapes(load_hf_config(model_dir))
    except (OSError, ValueError) as err:
        log.warning("publications to %s are not checked for completeness: %s", model_dir, err)
        return None


@dataclass
class GlooInitInfo:
    """Where the trainer's TCPStore listens and this engine's first rank in the group."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo:
    """The version the trainer is about to publish (the manifest itself comes on the wire)."""

    version: int


def engine_rank(rank_offset: int, parallel_config) -> int:
    """This vLLM worker's rank in the publication group: its rollout group's offset (1 + the workers of
    the groups before it: WeightPublisher.connect, publish/trainer.py) plus its place in its engine
    (data-parallel index x the engine's world size + its rank there).  The one formula of the backends."""
    pc = parallel_config
    return rank_offset + pc.data_parallel_index * pc.world_size + pc.rank


def _engine_base():
    from vllm.distributed.weight_transfer import WeightTransferEngine

    return WeightTransferEngine


class VerifiedCommit:
    """What the three backends share: a publication is staged, checked as a whole, then loaded
    into the model at finish_weight_update -- or dropped, and the model keeps serving the
    version it had.  Mixed into a vLLM WeightTransferEngine (needs self.model, model_config).

    Loading itself can still fail on one worker after others of the group succeeded (an
    out-of-memory error, a loader bug).  The group then decides together (RolloutWorker):
    every worker `rollback()`s to the version it served before -- the host copy of the last
    publication the whole group accepted (`accept(keep_copy=True)`), or for version 0 the
    checkpoint on disk -- so a group never serves half old, half new weights.
    """

    def _init_commit(self) -> None:
        self.rank = None
        self.staged: ReceivedPublication | None = None
        self.weights = FullWeights(self.model, self.model_config, expected_tensors(self.model_config.model))
        """What a version is here: FullWeights, or a LoRA run's AdapterStore (megatron_rl_serve_adapters)."""
        self.serving_dtype = dtype_name(self.model_config.dtype)  # what a publication must carry
        self.status: dict[str, Any] = {"version": None, "ok": None, "error": None, "bad_bucket": None}
        self.loaded: list[tuple[str, torch.Tensor]] | None = None  # loaded, not yet accepted by the group
        self.fail_load_after: int | None = None  # drills: the next load raises after this many tensors

    def _stage(self, got: ReceivedPublication, version: int) -> None:
        """Keep `got` for finish_weight_update if it is `version` and exactly the model's tensors."""
        if got.ok and got.manifest.version != version:
            got = ReceivedPublication(got.manifest,
                                      error=f"manifest version {got.manifest.version} != announced {version}")
        expected = self.weights.shapes
        if got.ok and expected is not None:
            problem = got.manifest.coverage_problem(expected)
            if problem is not None:
                got = ReceivedPublication(got.manifest, error=problem)
        if got.ok and self.serving_dtype is not None:  # None only for engines built without a model
            problem = got.manifest.dtype_problem(self.serving_dtype)
            if problem is not None:
                got = ReceivedPublication(got.manifest, error=problem)
        self.staged = got
        self.status = {"version": version, "ok": got.ok, "error": got.error, "bad_bucket": got.bad_bucket,
                       "rank": self.rank, "tensors": len(got.tensors),
                       "digest": got.manifest.digest() if got.ok else None}

    def verify(self, manifest: dict[str, Any]) -> None:
        """Kept-tensor backends (NCCL, IPC): check what `self.received` holds against the
        trainer's manifest, which travels separately; stage it only if all of it matches."""
        from megatron_rl.publish.manifest import PublicationManifest, verify_tensors

        received, self.received = getattr(self, "received", None), None
        if received is None:
            self.status = {"version": None, "ok": False, "error": "verify before any publication arrived",
                           "bad_bucket": None, "rank": self.rank, "tensors": 0}
            return
        version, kept = received
        try:
            parsed = PublicationManifest.from_dict(manifest)
        except ValueError as err:
            self._stage(ReceivedPublication(None, error=str(err)), version)
            return
        problem, bad = verify_tensors(parsed, kept)
        self._stage(ReceivedPublication(parsed, tensors=kept) if problem is None else
                    ReceivedPublication(parsed, error=problem, bad_bucket=bad), version)

    def finish_weight_update(self) -> None:
        staged, self.staged = self.staged, None
        self.loaded = None
        if staged is None or not staged.ok:
            log.warning("publication not committed: %s", None if staged is None else staged.error)
            self.status["committed"] = False
            return
        try:
            self.weights.install(self.status["version"], self._feed(self._drill_permute(staged.tensors)))
        except Exception as err:  # noqa: BLE001 -- reported; the group rolls every worker back
            log.error("rank %s: loading publication %s failed: %r", self.rank, self.status.get("version"), err)
            self.status.update(committed=False, ok=False, load_failed=True,
                               error=f"rank {self.rank}: load_weights failed: {err!r}")
            self._settle_after_failed_load()
            return
        self.loaded = staged.tensors
        self.status["committed"] = True

    def _feed(self, tensors):
        for i, item in enumerate(tensors):
            if self.fail_load_after is not None and i >= self.fail_load_after:
                self.fail_load_after = None
                raise RuntimeError(f"injected load failure after {i} tensors (drill)")
            yield item

    def _drill_permute(self, tensors):
        """Drill hook (`megatron-rl drill bad_refit`, megatron_rl/fault_hooks.py): at version at_version,
        load the first matrix with its rows reversed -- bytes that verified, laid out wrongly."""
        from megatron_rl.fault_hooks import drill_spec, record_injection

        spec = drill_spec("permute_load")
        done = getattr(self, "_drill_permuted", 0)
        if spec is None or self.status.get("version") != int(spec["at_version"]) or done >= int(spec.get("times", 1)):
            return tensors
        self._drill_permuted = done + 1
        tensors = list(tensors)
        i = next(k for k, (_, t) in enumerate(tensors) if t.dim() == 2)
        name, t = tensors[i]
        record_injection(spec, tensor=name, version=self.status.get("version"))
        tensors[i] = (name, t.flip(0))
        return tensors

    def _settle_after_failed_load(self) -> None:
        """Close the interrupted layerwise reload so every layer is materialised again (with
        mixed values) and a full reload -- the rollback -- starts from a clean state."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from megatron_rl.publish.vllm_moe import rearm_moe_kernels

        try:
            finalize_layerwise_reload(self.model, self.model_config)
        except Exception as err:  # noqa: BLE001 -- the rollback will report the worker broken
            log.error("rank %s: could not close the failed reload: %r", self.rank, err)
        finally:
            rearm_moe_kernels(self.model)

    def accept(self, keep_copy: bool) -> None:
        """Every worker of the group loaded the publication: it is now the version a later
        failed load rolls back to (FullWeights keep a host copy, or none when keep_copy is off;
        an AdapterStore keeps the newest adapters anyway)."""
        loaded, self.loaded = self.loaded, None
        self.weights.keep(loaded, keep_copy)

    def rollback(self) -> None:
        """Serve again the version served before the failed publication (raises if none is kept): reloaded
        full weights, or a LoRA run's new adapter dropped (the versions before it were never unloaded)."""
        self.loaded = None
        self.weights.roll_back(self.status["version"], self._feed)


class GlooWeightTransferEngine(VerifiedCommit, _engine_base()):
    """Receives publications by gloo broadcast from the trainer (rank 0) and verifies them."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._init_commit()
        self.group = None
        self.staging = StagingBuffers()  # reused by every publication; emptied into the model at finish

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join the trainer's group; a group joined before (a regroup, a restarted trainer) goes first."""
        self._leave_group()
        self.rank = engine_rank(init_info.rank_offset, self.parallel_config)
        log.info("joining publication group at %s:%d as rank %d of %d",
                 init_info.master_address, init_info.master_port, self.rank, init_info.world_size)
        self.group = open_group(
            init_info.master_address, init_info.master_port, self.rank, init_info.world_size, init_info.timeout_s
        )

    def start_weight_update(self) -> None:
        self.staged = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class would call torch.accelerator.synchronize(); nothing is async here.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer used before init_weight_transfer_engine")
        self._stage(receive_publication(self.group, self.staging), update_info.version)

    def shutdown(self) -> None:
        self._leave_group()
        self.staged = None
        self.staging = StagingBuffers()

    def _leave_group(self) -> None:
        group, self.group = self.group, None
        release_gloo_group(group)


class PublicationWorkerExtension:
    """Mixed into vLLM's worker class (worker_extension_cls): status + equality debug hooks."""

    def megatron_rl_publication_status(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(engine.status) if isinstance(engine, VerifiedCommit) else {}

    def megatron_rl_verify_publication(self, manifest: dict) -> dict[str, Any]:
        """Check what the NCCL backend staged against the trainer's manifest; returns the status."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not hasattr(engine, "verify"):
            raise RuntimeError(f"weight transfer backend is not {NCCL_BACKEND}: nothing to verify")
        engine.verify(manifest)
        return dict(engine.status)

    def megatron_rl_serve_adapters(self, spec: dict) -> None:
        """A LoRA run: from now on each publication is an adapter (publish/vllm_adapters.py adapter_spec)."""
        from megatron_rl.publish.vllm_adapters import AdapterStore

        self._commit_engine().weights = AdapterStore(getattr(self.model_runner, "lora_manager", None), spec)

    def megatron_rl_restore_adapters(self) -> None:
        """A LoRA run: the kept adapters back into vLLM's cache, which every weight update session empties."""
        self._commit_engine().weights.restore()

    def megatron_rl_drop_publication(self) -> None:
        """Discard a staged publication (another worker of the group refused it)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if isinstance(engine, VerifiedCommit):
            engine.staged = None

    def megatron_rl_accept_publication(self, keep_copy: bool) -> None:
        """Every worker loaded the publication: make it the version to roll back to."""
        self._commit_engine().accept(keep_copy)

    def megatron_rl_rollback_publication(self) -> dict[str, Any]:
        """Reload the previous version after a failed load somewhere in the group."""
        engine = self._commit_engine()
        try:
            engine.rollback()
        except Exception as err:  # noqa: BLE001 -- reported to the group, which stops serving
            return {"rank": engine.rank, "ok": False, "error": repr(err)}
        return {"rank": engine.rank, "ok": True, "error": None}

    def megatron_rl_fail_next_load(self, after_tensors: int, worker_rank: int | None = None) -> None:
        """Drill hook: the next load on this engine worker (or only on worker `worker_rank`,
        the vLLM rank inside the group) raises after `after_tensors` tensors."""
        if worker_rank is None or getattr(self, "rank", None) == worker_rank:
            self._commit_engine().fail_load_after = int(after_tensors)

    def _commit_engine(self) -> VerifiedCommit:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, VerifiedCommit):
            raise RuntimeError("weight transfer backend is not one of megatron-rl's checked backends")
        return engine

    def megatron_rl_gpu_uuid(self) -> str:
        """UUID of this worker's GPU (the key of the IPC handle it opens; publish/ipc_route.py)."""
        from megatron_rl.publish.ipc_route import gpu_uuid

        return gpu_uuid()

    def megatron_rl_weight_checksum(self) -> float:
        """Sum of all parameters of this worker's shard (a cheap equality probe for tests)."""
        model = self.model_runner.get_model()
        with torch.no_grad():
            return float(sum(p.double().sum() for p in model.parameters()))


register()
