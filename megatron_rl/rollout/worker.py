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
import socket
import time
from typing import Any

from megatron_rl.fault_hooks import maybe_kill_engine
from megatron_rl.platform.priority import with_normal_priority
from megatron_rl.publish.vllm_adapters import ServedAdapters
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine_setup import (engine_env, engine_identity, eos_token_ids, llm_kwargs, prepare_actor,
                                              watched)
from megatron_rl.rollout.provenance import token_provenance, weights_label
from megatron_rl.rollout.receiver import PublicationReceiving
from megatron_rl.rollout.requests import (call_params, check_prompts, finish_reason, prompt_params, sampled_logprobs,
                                          sampling_defaults)
from megatron_rl.rollout.sample import PromptInfo, RolloutSample
from megatron_rl.rollout.turn_batcher import TurnResult, play_in_lockstep

log = logging.getLogger(__name__)


class RolloutWorker(PublicationReceiving):
    """One vLLM engine.  Methods are called through Ray (`.remote`) or directly.  Publications are received by
    the part it holds (rollout/receiver.py); it supplies the swap (`_commit`: between calls, all or nothing)."""

    def __init__(self, config: RolloutConfig | dict, stale: bool = False):
        """`stale`: a restarted group (RolloutFleet): its engine loads the checkpoint on disk, which is
        no version of this run, so it serves nothing (version None) until a publication commits."""
        import torch

        self.config = RolloutConfig.of(config)
        on_gpu = torch.cuda.is_available()
        os.environ.update(engine_env(self.config, on_gpu))  # before anything of vLLM is imported
        prepare_actor(self.config)
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

        check_prompts(prompts)
        params = call_params(self.config, self.eos_token_ids, len(prompts), sampling, n, info)
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
                    finish_reason=finish_reason(c.finish_reason),
                    started_at=started, finished_at=finished,
                    prompt=info[i] if info else PromptInfo(), weights=weights,
                ))
        assert version == self.version  # nothing switched the weights during the call
        return samples

    def run_episodes(self, examples: list, sampling: dict[str, Any] | None = None, n: int = 1,
                     info: list | None = None, env: dict | None = None) -> list:
        """n multi-turn episodes of each example with environment `env` (an EnvConfig as a dict), prompt-major and
        seeded as on the streaming engine (rollout/episodes.py plays them); here the episodes advance in lockstep,
        one engine call per turn of those still playing (rollout/turn_batcher.py)."""
        params = call_params(self.config, self.eos_token_ids, len(examples), sampling, n, info)
        self._serving_version()
        return play_in_lockstep(self._generate_turns, env or {}, self.config.model, examples, params, n, info)

    def _generate_turns(self, turns: list) -> list:
        """One engine call for a batch of episodes' turns (rollout/turn_batcher.py Turn): each its own request
        with its own seed, answered with its tokens, logprobs and the one version that sampled them (a LoRA
        run's: its adapter, as in generate)."""
        from vllm import SamplingParams

        version = self._serving_version()
        per_turn = [SamplingParams(n=1, logprobs=0, flat_logprobs=True, detokenize=False, **t.params) for t in turns]
        outputs = self._watched(lambda: self.llm.generate([{"prompt_token_ids": t.tokens} for t in turns], per_turn,
                                                          use_tqdm=False, lora_request=self.adapters.request(version)))
        results = []
        for turn, out in zip(turns, outputs, strict=True):
            c = out.outputs[0]
            tokens = list(c.token_ids)
            versions, weights = token_provenance(c.weight_versions, len(tokens), self.label)
            assert set(versions) <= {version}, (versions, version)  # nothing switched the weights during the call
            results.append(TurnResult.of_one_version(
                turn.request_id, turn.tokens, tokens, sampled_logprobs(c.logprobs, tokens),
                finish_reason(c.finish_reason), version, weights))
        return results

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

    # ---- the engine, as the receiving part (rollout/receiver.py) needs it -------------------
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
        return self._answer(version, bad, statuses)

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

    def sleep(self, level: int) -> None:
        """vLLM sleep mode (rollout/sleep.py): free this engine's GPU memory while the learner learns."""
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo sleep(): weights back, KV cache re-allocated, scheduling resumed (tags None: all)."""
        self.llm.wake_up(tags)

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


def wait_engines_up(workers: list, first_group: int = 0) -> None:
    """Block until each rollout actor (either engine) is up -- raising the error of one that failed to start --
    and log, on the driver, the process it runs in: the pid its lines carry in RUN_DIR/logs/ray_<Actor>.log
    (what to look for there, or attach a profiler to)."""
    import ray

    where = ray.get([w.__ray_call__.remote(_process) for w in workers])
    log.info("rollout engines up: %s", ", ".join(f"group {g} in process {pid} on {host}"
                                                  for g, (pid, host) in enumerate(where, start=first_group)))


def _process(_actor) -> tuple[int, str]:
    return os.getpid(), socket.gethostname()
