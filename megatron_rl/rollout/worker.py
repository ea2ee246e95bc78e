"""RolloutWorker: a Ray actor owning one vLLM engine; token ids in, RolloutSamples out.

    import ray
    from megatron_rl.rollout import RolloutConfig, create_rollout_worker
    ray.init(num_cpus=2, include_dashboard=False)
    worker = create_rollout_worker(RolloutConfig(model="/tmp/tiny", tensor_parallel_size=2))
    samples = ray.get(worker.generate.remote([[1, 23, 24]], {"max_tokens": 16}, n=4))

Each actor is one rollout group (vLLM with its own tensor_parallel_size); several actors
are data-parallel groups.  `RolloutWorker` is also usable as a plain object in-process.

In-flight requests and weight publication: an actor runs one method at a time, so a
publication (`receive_weights`) is queued behind a running `generate` and runs between
calls: no request is ever in flight across a version switch.  Every response token is
stamped with the version that was active during its generate call, so a future
in-flight-update scheme can keep the same sample contract.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from megatron_rl.fault_hooks import maybe_kill_engine, maybe_kill_engine_in_publication, maybe_stop_group
from megatron_rl.platform.priority import with_normal_priority
from megatron_rl.publish.vllm_adapters import ServedAdapters
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine_setup import (engine_env, engine_identity, eos_token_ids, llm_kwargs, transfer_path,
                                              prepare_actor, watched)
from megatron_rl.rollout.provenance import token_provenance, weights_label
from megatron_rl.rollout.requests import call_params, check_prompts, prompt_params, sampled_logprobs, sampling_defaults
from megatron_rl.rollout.sample import PromptInfo, RolloutSample

log = logging.getLogger(__name__)

class RolloutWorker:
    """One vLLM engine.  Methods are called through Ray (`.remote`) or directly."""

    def __init__(self, config: RolloutConfig | dict, stale: bool = False):
        """`stale`: a restarted group (RolloutFleet): its engine loads the checkpoint on disk, which is
        no version of this run, so it serves nothing (version None) until a publication commits."""
        import torch

        self.config = RolloutConfig.of(config)
        prepare_actor(self.config)
        on_gpu = torch.cuda.is_available()
        os.environ.update(engine_env(self.config, on_gpu))
        from vllm import LLM

        if not self.config.model or not os.path.isdir(self.config.model):
            raise FileNotFoundError(f"rollout.model: no checkpoint directory {self.config.model}")
        started = time.perf_counter()
        self.llm = LLM(**llm_kwargs(self.config, on_gpu))
        self.version = None if stale else 0
        self.adapters = ServedAdapters(self.config.adapter)  # a LoRA run: versions are adapters
        self.adapters.start(self.llm, self.config.model)
        self._set_label(None)
        # Without a tokenizer vLLM does not know EOS: stop on the checkpoint's eos ids.
        self.eos_token_ids = eos_token_ids(self.config.model)
        log.info("vLLM engine for %s (TP=%d) up in %.1f s", self.config.model,
                 self.config.tensor_parallel_size, time.perf_counter() - started)

    def reset(self, config: RolloutConfig | dict) -> None:
        """Hand this engine to the next run of an experiment (train/engine_pool.py): it takes that run's
        rollout config and EOS ids, and serves nothing (version None) until that run's first publication
        (its initial weights, version 0) committed on it, checksums and refit check included."""
        import torch

        new = RolloutConfig.of(config)
        on_gpu = torch.cuda.is_available()
        if engine_identity(new, on_gpu) != engine_identity(self.config, on_gpu):
            raise ValueError(f"rollout engine for {self.config.model} cannot serve {new.model}: the engine "
                             "arguments or the model's shapes differ")
        self.config, self.version, self._probe = new, None, None
        self.adapters = ServedAdapters(new.adapter)
        self.eos_token_ids = eos_token_ids(new.model)
        self.llm.reset_prefix_cache()
        self._set_label(None)
        log.info("vLLM engine handed to the next run (%s): stale until its first publication", new.model)

    # ---- generation -------------------------------------------------------------------
    def sampling_defaults(self) -> dict[str, Any]:
        return sampling_defaults(self.config)

    def generate(
        self, prompts: list[list[int]], sampling: dict[str, Any] | None = None, n: int = 1,
        info: list[PromptInfo] | None = None,
    ) -> list[RolloutSample]:
        """Sample `n` responses per prompt; returns len(prompts) * n samples, prompt-major.

        `sampling` overrides the config defaults (keys: temperature, top_p, top_k,
        max_tokens, seed, stop_token_ids, ignore_eos).  With a `seed`, prompt i uses
        seed + i, so results are reproducible and prompts differ.  info[i] (a PromptInfo) rides on
        prompt i's samples, and its max_tokens caps theirs.
        """
        from vllm import SamplingParams

        params = self._request_params(prompts, sampling, n, info)
        per_prompt = []
        for i in range(len(prompts)):
            seed = None if params["seed"] is None else params["seed"] + i
            per_prompt.append(SamplingParams(n=n, logprobs=0, flat_logprobs=True, detokenize=False,
                                             **{**prompt_params(params, info, i), "seed": seed}))
        version = self._serving_version()
        started = time.time()
        maybe_kill_engine(self.llm, info)  # drill hook (engine_kill); no-op without MEGATRON_RL_DRILL
        lora = self.adapters.request(version)
        outputs = self._watched(lambda: self.llm.generate([{"prompt_token_ids": p} for p in prompts], per_prompt,
                                                          use_tqdm=False, lora_request=lora))
        finished = time.time()
        samples = []
        for i, out in enumerate(outputs):
            used = {**prompt_params(params, info, i), "seed": per_prompt[i].seed, "n": n}
            for c in out.outputs:
                tokens = list(c.token_ids)
                logprobs = sampled_logprobs(c.logprobs, tokens)
                # Each token's version as the engine labelled the weights that sampled it (rollout/provenance.py).
                versions, weights = token_provenance(c.weight_versions, len(tokens), self.label)
                samples.append(RolloutSample(
                    prompt_tokens=list(prompts[i]), response_tokens=tokens, behavior_logprobs=logprobs,
                    policy_versions=versions, sampling=used,
                    finish_reason=c.finish_reason if c.finish_reason in ("stop", "length") else "abort",
                    started_at=started, finished_at=finished,
                    prompt=info[i] if info else PromptInfo(), weights=weights,
                ))
        assert version == self.version  # nothing switched the weights during the call
        return samples

    def _request_params(self, prompts: list[list[int]], sampling: dict[str, Any] | None, n: int,
                        info: list[PromptInfo] | None) -> dict[str, Any]:
        """generate's arguments checked, and the sampling parameters they ask for (EOS ids added)."""
        check_prompts(prompts)
        return self._call_params(len(prompts), sampling, n, info)

    def _call_params(self, count: int, sampling: dict[str, Any] | None, n: int,
                     info: list[PromptInfo] | None) -> dict[str, Any]:
        """The checks and sampling parameters of a call on `count` prompts (or episode examples), n each
        (rollout/requests.py, shared with the streaming actor)."""
        return call_params(self.config, self.eos_token_ids, count, sampling, n, info)

    def score(self, sequences: list[list[int]], version: int | None = None) -> list[list[float | None]]:
        """Teacher-forced logprob of every token given its prefix (first is None) [T], under the serving
        version (a LoRA run: under `version`'s adapter when given, e.g. one being checked)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0)
        lora = self.adapters.request(self.version if version is None else version, installed=version is not None)
        outs = self._watched(lambda: self.llm.generate([{"prompt_token_ids": s} for s in sequences], params,
                                                       use_tqdm=False, lora_request=lora))
        return [[None] + [float(lp[t].logprob) for lp, t in zip(o.prompt_logprobs[1:], s[1:])]
                for o, s in zip(outs, sequences)]

    def _watched(self, call):
        """`call()`, raising vLLM's EngineDeadError if the engine-core process dies meanwhile (engine_setup.watched)."""
        return watched(self.llm, call)

    # ---- weight publication (receive side) ----------------------------------------------
    def policy_version(self) -> int:
        return self.version

    def engine_alive(self) -> bool:
        """False once this group's vLLM engine-core process has died (the actor itself still answers)."""
        resources = getattr(self.llm.llm_engine.engine_core, "resources", None)
        return not (resources is not None and resources.engine_dead)

    def engine_world_size(self) -> int:
        """Number of vLLM worker processes in this group (each one joins publication)."""
        pc = self.llm.llm_engine.vllm_config.parallel_config
        return pc.world_size

    def _model_config(self):
        """vLLM's ModelConfig of the engine this group serves with."""
        return self.llm.llm_engine.vllm_config.model_config

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

    def _commit(self, version: int, statuses: list[dict[str, Any]]) -> dict[str, Any]:
        """All or nothing over the group: every worker verified, the prefix cache is empty, and
        every worker loaded -- or the group keeps (or, after a failed load, reloads) the version
        it served."""
        bad = [s for s in statuses if not s.get("ok")]
        # Cached prefix KV is computed with the weights serving now: emptied before the switch
        # (nothing runs in between, the actor serves one call at a time), or no switch at all.
        if not bad and not self.llm.reset_prefix_cache():
            bad = [{"ok": False, "bad_bucket": None,
                    "error": "vLLM did not reset its prefix cache (requests running?): publication not loaded"}]
        if bad:
            self.llm.collective_rpc("megatron_rl_drop_publication")
        self._finish_update()
        if not bad:
            loaded = self.llm.collective_rpc("megatron_rl_publication_status")
            bad = [s for s in loaded if not s.get("committed")]
            if not bad:  # the bytes verified and loaded: do the weights compute what the learner's do?
                refit = self._refit_check(version)
                bad = [refit] if refit else []
            if bad:
                self._roll_back(version, bad)
            else:
                self.llm.collective_rpc("megatron_rl_accept_publication", args=(self.config.keep_rollback_copy,))
                self.version = int(version)
                self._set_label(statuses[0].get("digest") if statuses else None)
                self.adapters.committed(self.version)
        if bad:
            log.warning("refused publication %d, serving version %s: %s", version, self.version, bad[0]["error"])
        return {
            "committed": not bad,
            "version": self.version,
            "error": bad[0]["error"] if bad else None,
            "bad_bucket": bad[0].get("bad_bucket") if bad else None,
            "workers": statuses,
        }

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

    def _roll_back(self, version: int, failed: list[dict[str, Any]]) -> None:
        """A worker failed to load `version` after others may have: every worker reloads the
        version served before.  If that fails too the group serves nothing (version None)."""
        self.llm.reset_prefix_cache()
        results = self.llm.collective_rpc("megatron_rl_rollback_publication")
        broken = [r for r in results if not r["ok"]]
        if broken:
            log.error("rollback after failed load of version %d failed (%s): this group serves no version until "
                      "a publication commits", version, broken[0]["error"])
            self.version = None
            self._set_label(None)
        else:
            log.warning("load of version %d failed on %d worker(s) (%s): rolled back to version %d",
                        version, len(failed), failed[0]["error"], self.version)

    def _set_label(self, digest: str | None) -> None:
        """Label the engine's weights "<version>:<digest>" (rollout/provenance.py): vLLM stamps every token
        it samples from now on with it."""
        self.label = weights_label(self.version, digest)
        self.llm.llm_engine.set_weight_version(self.label)

    def _serving_version(self) -> int:
        if self.version is None:
            raise RuntimeError("this rollout group holds no complete policy version (a failed load could not be "
                               "rolled back); it serves again after the next committed publication")
        return self.version

    def sleep(self, level: int) -> None:
        """vLLM sleep mode (rollout/sleep.py): free this engine's GPU memory while the learner learns."""
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo sleep(): weights back, KV cache re-allocated, scheduling resumed (tags None: all)."""
        self.llm.wake_up(tags)

    def fail_next_load(self, after_tensors: int, worker_rank: int | None = None) -> None:
        """Drill hook: the next publication's load raises on engine worker `worker_rank` (all if None)."""
        self.llm.collective_rpc("megatron_rl_fail_next_load", args=(after_tensors, worker_rank))

    def weight_checksums(self) -> list[float]:
        """Per-worker parameter sums (debug: weights equal after a sync)."""
        return self.llm.collective_rpc("megatron_rl_weight_checksum")

    def _require_transfer(self) -> None:
        if self.config.weight_transfer == "none":
            raise ValueError("rollout.weight_transfer is 'none': this worker cannot receive weights")

    def shutdown(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


def create_rollout_worker(config: RolloutConfig, stale: bool = False, **ray_options):
    """Start a RolloutWorker Ray actor (ray.init must have run); returns its handle.  A `stale` one
    (a restart) serves nothing until a publication commits on it."""
    import ray

    options = with_normal_priority({"num_cpus": config.num_cpus, **ray_options})
    return ray.remote(RolloutWorker).options(**options).remote(dataclasses.asdict(config), stale)
