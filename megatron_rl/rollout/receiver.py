"""The receive side of weight publication, the part both rollout engines are built from: the round engine
(RolloutWorker, rollout/worker.py: vLLM's offline LLM) and the streaming one (StreamRolloutWorker,
rollout/stream_actor.py: vLLM's async engine) are siblings that each hold it; neither inherits the other.

    class RolloutWorker(PublicationReceiving): ...   # supplies _commit: how its engine swaps, all or nothing

What it does for either engine: join the trainer's publication group, receive a publication (gloo: the
manifest on the wire; NCCL / IPC: the tensors kept, then `commit_weights(manifest)`), check what every
engine worker kept, the refit check (the engine's logprobs on the learner's probe, rollout/refit_check.py),
and the group's serving version.  What each engine supplies (the contract, checked by nothing but its use):

    config, llm        RolloutConfig; the engine's blocking calls (start/update/finish_weight_update,
                       collective_rpc, init_weight_transfer_engine, reset_prefix_cache)
    adapters           ServedAdapters (publish/vllm_adapters.py): a LoRA run's served versions
    version            the committed version it serves (None: none, after a failed rollback)
    _commit(v, statuses) -> answer   the swap: the offline engine between calls, the streaming one in flight
    score(sequences, version), _model_config()
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_rl.fault_hooks import maybe_kill_engine_in_publication, maybe_stop_group
from megatron_rl.rollout.engine_setup import transfer_path

log = logging.getLogger(__name__)


class PublicationReceiving:
    """Receive, verify and commit publications on an engine that supplies `_commit` (module docstring)."""

    def policy_version(self) -> int:
        return self.version

    def serving_dtype(self) -> str:
        """The dtype (name, e.g. "bfloat16") the engine serves; publications must carry it."""
        return str(self._model_config().dtype).removeprefix("torch.")

    def refit_tolerance(self, configured: float | str | None) -> float | None:
        """run.refit_tolerance resolved for what this engine serves: its dtype and its model's depth."""
        from megatron_rl.rollout.refit_check import refit_tolerance

        hf = self._model_config().hf_text_config
        return refit_tolerance(self.serving_dtype(), configured, int(getattr(hf, "num_hidden_layers", 1) or 1))

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's publication group (blocks until every rank has joined)."""
        self._require_transfer()
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def receive_weights(self, version: int, metadata: list | None = None,
                        ipc_handles: str | None = None) -> dict[str, Any] | None:
        """Receive one publication.

        gloo: the manifest comes on the wire; commits it on every worker of the group or on
        none and returns {"committed", "version" (now serving), "error", "bad_bucket", "workers"}.
        nccl / ipc: `metadata` [(name, dtype name, shape)] says what arrives (ipc: and
        `ipc_handles`, pickled, where it lies); the tensors are only kept, and
        commit_weights(manifest) decides (returns None here).
        """
        self._require_transfer()
        info: dict[str, Any] = {"version": int(version)}
        kept = transfer_path(self.config).commits_by_rpc
        if kept:
            if metadata is None:
                raise ValueError(f"a {self.config.weight_transfer} publication needs the tensors' "
                                 "(name, dtype, shape) up front")
            info.update(names=[m[0] for m in metadata], dtype_names=[m[1] for m in metadata],
                        shapes=[list(m[2]) for m in metadata])
        if ipc_handles is not None:
            info["ipc_handles_pickled"] = ipc_handles
        maybe_stop_group(int(version))  # drill hooks (engine_stop, engine_kill_publish); no-ops without
        maybe_kill_engine_in_publication(int(version))  # MEGATRON_RL_DRILL
        self.llm.start_weight_update()
        try:
            self.llm.update_weights({"update_info": info})
        except Exception as err:  # noqa: BLE001 -- the link broke (trainer timed out on a stopped peer)
            if kept:
                raise
            return self._broken_off(version, err)
        if kept:
            return None
        return self._commit(version, self.llm.collective_rpc("megatron_rl_publication_status"))

    def _broken_off(self, version: int, err: Exception) -> dict[str, Any]:
        """A gloo publication that broke off mid-stream (vLLM closed the update session with the error;
        nothing was staged, so nothing loads): keep serving the version this group had."""
        last = str(err).strip().splitlines()
        log.warning("publication %d broke off (%s); serving version %s", version, last[-1] if last else err,
                    self.version)
        return {"committed": False, "version": self.version, "bad_bucket": None, "workers": [], "broken_off": True,
                "error": f"publication {version} broke off: {last[-1] if last else err!r}"}

    def commit_weights(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """NCCL / IPC: check what every worker kept against the trainer's manifest; commit on all or none."""
        if not transfer_path(self.config).commits_by_rpc:
            raise ValueError(f"commit_weights is for a path that commits by RPC, not rollout.weight_transfer "
                             f"{self.config.weight_transfer!r} (which commits in receive_weights)")
        try:
            statuses = self.llm.collective_rpc("megatron_rl_verify_publication", args=(manifest,))
        except Exception:
            # Close the update session either way, or the next publication cannot start.
            self.llm.collective_rpc("megatron_rl_drop_publication")
            self._finish_update()
            raise
        return self._commit(int(manifest.get("version", -1)), statuses)

    def expect_probe(self, version: int, sequences: list[list[int]], logprobs: list[list[float]],
                     tolerance: float | str) -> None:
        """The refit check's reference for publication `version`: the learner's logprobs [B][T-1] of
        the probe `sequences` [B][T] under the weights it is about to publish; `tolerance` a number,
        or "auto" for this engine's serving dtype's bound (rollout/refit_check.py)."""
        self._probe = (int(version), sequences, logprobs, tolerance)

    def _refit_check(self, version: int) -> dict[str, Any] | None:
        """None when this group's freshly loaded weights give the learner's probe logprobs (median
        |Δ| within the tolerance: rollout/refit_check.py), else a failed status: bytes that verify but
        were laid out wrongly (a permuted or mis-mapped tensor) are refused like a failed load, and the
        group rolls back."""
        from megatron_rl.rollout.refit_check import probe_verdict

        probe = getattr(self, "_probe", None)
        if probe is None or probe[0] != version:
            return None
        _, sequences, expected, configured = probe
        tolerance = self.refit_tolerance(configured)
        stats, problem = probe_verdict(self.score(sequences, version), expected, tolerance)
        if problem is None:
            log.info("refit check of version %d: median |Δ logprob| %.3g (mean %.3g) over %d probe tokens",
                     version, stats["median"], stats["mean"], stats["tokens"])
            return None
        return {"ok": False, "committed": False, "bad_bucket": None,
                "error": f"refit check: version {version} loaded, but its logprobs on the probe differ from the "
                         f"learner's: {problem} (run.refit_tolerance {configured}; tensors laid out wrongly?)"}

    def _finish_update(self) -> None:
        """Close the weight update session (a LoRA run: vLLM empties its adapter cache then; put them back)."""
        self.llm.finish_weight_update()
        self.adapters.session_closed(self.llm)

    def _serving_version(self) -> int:
        if self.version is None:
            raise RuntimeError("this rollout group holds no complete policy version (a failed load could not be "
                               "rolled back); it serves again after the next committed publication")
        return self.version

    def fail_next_load(self, after_tensors: int, worker_rank: int | None = None) -> None:
        """Drill hook: the next publication's load raises on engine worker `worker_rank` (all if None)."""
        self.llm.collective_rpc("megatron_rl_fail_next_load", args=(after_tensors, worker_rank))

    def weight_checksums(self) -> list[float]:
        """Per-worker parameter sums (debug: weights equal after a sync)."""
        return self.llm.collective_rpc("megatron_rl_weight_checksum")

    def _require_transfer(self) -> None:
        if self.config.weight_transfer == "none":
            raise ValueError("rollout.weight_transfer is 'none': this worker cannot receive weights")

    def _answer(self, version: int, bad: list[dict], statuses: list[dict]) -> dict[str, Any]:
        """What a publication's commit answers: committed or not, the version serving now, the first problem."""
        if bad:
            log.warning("refused publication %d, serving version %s: %s", version, self.version, bad[0].get("error"))
        return {"committed": not bad, "version": self.version, "error": bad[0].get("error") if bad else None,
                "bad_bucket": bad[0].get("bad_bucket") if bad else None, "workers": statuses}
