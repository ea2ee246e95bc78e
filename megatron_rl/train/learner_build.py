"""How a learner rank is built: torch.distributed, the Megatron learner, the initial policy from a
Hugging Face checkpoint (through the shared conversion mapping) and the frozen reference model.

    class LearnerWorker(RankBuild, ...)   # train/learner_group.py
    worker.setup(master_addr, master_port, sampling)

`seed_everything` sets seeds, threads and deterministic mode of a process (the driver's too).
"""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch

logger = logging.getLogger(__name__)

def seed_everything(seed: int, deterministic: bool | None, threads: int) -> None:
    """Seeds, threads and deterministic mode (None: on for CPU, off on GPU; platform.apply_determinism)."""
    from megatron_rl.platform import apply_determinism

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    apply_determinism(deterministic, cuda=torch.cuda.is_available())


class RankBuild:
    """Mixin of LearnerWorker: needs self.rank, self.world_size and self._args (its __init__)."""

    def rendezvous_address(self) -> tuple[str, int]:
        """(this node's IP, the port rank 0's rendezvous store listens on).  The store binds port 0
        (the OS picks a free one and binds it at once) before any rank is told the port, so no other
        process can take it in between, as a port probed free and bound later by
        init_process_group could be (EADDRINUSE; the publication group had the same fix, wire.host_store)."""
        import ray

        from megatron_rl.publish.wire import host_store

        host = ray.util.get_node_ip_address()
        self._rendezvous_store = host_store(host, self.world_size)
        return host, self._rendezvous_store.port

    def join(self, master_addr: str, master_port: int, platform) -> None:
        """Join torch.distributed through rank 0's store (rendezvous_address): rank 0 passes the
        store it already listens on, the other ranks connect to it as clients.  A process that is already
        a rank (tests/dist: run_distributed set torch.distributed up) joins nothing."""
        import datetime

        import torch.distributed as dist

        from megatron_rl.platform.parallel import init_distributed

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        store = getattr(self, "_rendezvous_store", None) if self.rank == 0 else None
        if dist.is_initialized():  # a process that is already a rank (tests/dist): nothing to join
            init_distributed(platform, rank=self.rank, world_size=self.world_size)
            return
        if store is None:
            if self.rank == 0:
                raise RuntimeError("learner rank 0 joins before rendezvous_address() made its store")
            store = dist.TCPStore(master_addr, master_port, self.world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=600))
        init_distributed(platform, rank=self.rank, world_size=self.world_size, store=store)

    def setup(self, master_addr: str, master_port: int, sampling=None) -> int:
        """Join torch.distributed, build the learner (scoring under `sampling`) and load the initial policy."""
        from megatron_rl.platform import detect_platform

        learner_cfg, _, _, seed, deterministic, threads = self._args
        seed_everything(seed, deterministic, threads)
        self.platform = detect_platform(dtype=learner_cfg.dtype)
        self.join(master_addr, master_port, self.platform)
        return self._build(sampling)

    def rebuild(self, args: tuple, sampling=None) -> int:
        """Serve the next run of an experiment in this process (train/engine_pool.py): the last run's
        learner, reference, optimizer, publication group and Megatron parallel state are dropped, and
        everything `setup` builds is built anew from `args` (that run's sections, initial policy and
        seed) in the same order; torch.distributed (same world size) stays up."""
        import gc

        from megatron_rl.platform import detect_platform
        from megatron_rl.platform.parallel import destroy_parallel

        old = getattr(self, "learner", None)
        if old is not None:
            old.close()
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            destroy_parallel()
        kept = {k: self.__dict__[k] for k in ("rank", "world_size", "_rendezvous_store") if k in self.__dict__}
        self.__dict__.clear()
        self.__dict__.update(kept, _args=args)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the last run's model and optimizer states back to the device
        learner_cfg, _, _, seed, deterministic, threads = args
        seed_everything(seed, deterministic, threads)
        self.platform = detect_platform(dtype=learner_cfg.dtype)
        rank = self._build(sampling)
        logger.info("learner rank %d rebuilt in its process for the next run (%s, seed %d)", self.rank, args[2], seed)
        return rank

    def _build(self, sampling=None) -> int:
        """The learner, its initial policy from the HF checkpoint, and the reference (after the join)."""
        from megatron_rl.conversion.hf_io import HFCheckpoint
        from megatron_rl.conversion.model_io import fill_from_hf
        from megatron_rl.learner import Learner
        from megatron_rl.models.hf_config import load_hf_config, padded_vocab_size

        learner_cfg, loss_cfg, hf_dir, _, _, _ = self._args
        self.loss_cfg = loss_cfg
        self.hf_cfg = load_hf_config(hf_dir)
        self.publish_device = "cpu"  # where published tensors are materialised (connect_rollout)
        self.publish_dtype = torch.float32  # the engines' dtype once connected (connect_rollout)
        self.learner = Learner(learner_cfg, self.hf_cfg, self.platform, sampling=sampling)
        from megatron.core import parallel_state as ps

        tp = learner_cfg.tensor_parallel_size
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.padded_vocab = padded_vocab_size(self.hf_cfg.vocab_size, tp)
        ckpt = HFCheckpoint(hf_dir, self.hf_cfg)
        fill_from_hf(self.learner.model[0].module, self.hf_cfg, ckpt, self.tp_rank, tp, self.padded_vocab)
        # Megatron's optimizer keeps fp32 main params for bf16 models: copy the loaded weights in.
        if hasattr(self.learner.optimizer, "reload_model_params"):
            self.learner.optimizer.reload_model_params()
        self.hf_dir, self._ckpt = hf_dir, ckpt
        self.reference = self._build_reference() if loss_cfg.kl_coef > 0 else None
        return self.rank

    def _build_reference(self):
        """A frozen copy of the initial policy, same layout, forward only."""
        from megatron_rl.conversion.model_io import fill_from_hf
        from megatron_rl.models.builder import build_gpt_model

        lc = self.learner.cfg
        ref = build_gpt_model(self.hf_cfg, platform=self.platform, tp=lc.tensor_parallel_size,
                              pp=lc.pipeline_parallel_size, config=self.learner.config)
        fill_from_hf(ref, self.hf_cfg, self._ckpt, self.tp_rank, lc.tensor_parallel_size, self.padded_vocab)
        ref.requires_grad_(False)
        return ref
