"""GPU check, stage 1: what a node with torch and megatron-core (and this project) can prove alone.

    python tests/gpu/stage1.py                  # on a CUDA machine: NCCL, bf16, local (non-TE) layers
    python tests/gpu/stage1.py --device cpu     # the CPU dry mode: the same logic on gloo (CI runs it)
    python tests/gpu/stage1.py --device cpu --break ipc   # a fault injected: the run must fail, naming the part

Needs no Transformer Engine, vLLM, Ray, PyYAML or package index: torch, megatron-core (numpy and
packaging, its own dependencies), blake3 (the publication checksum) and this project.  Budget:
<= 3 minutes on one GPU (mostly start-up), well under a minute on CPU.  tests/gpu/run_gpu_checks.sh
runs it first; README "GPU stage 1 on a node without network" says how to bring it to such a node.

One learner rank (this process; torch.distributed on NCCL, or gloo in the CPU dry mode), a tiny
Llama built by the project's own Learner (models/builder.py) on local layers, trained with the
project's GRPO loss as a learner rank does (ranks/rank.py):
  1 learner_step   one optimizer step on a GRPO batch: finite loss and grad norm, the update applied;
  2 checkpoint     the driver's checkpoint round trip (train/checkpointing.py, without the
                   coordinator): save_checkpoint with the learner's distributed checkpoint, probe and
                   RNG states; load_checkpoint (sha256 of every file) into a fresh learner built from
                   another seed, RNG restored, the shadow forward, and the next step's loss identical
                   to the one the uninterrupted learner takes (the step after it too: exact on CPU,
                   within 1e-3 on a GPU, whose backward is not bitwise reproducible);
  3 ipc_digest     a publication of the trained weights to a second process: the HF tensors hashed by
                   ManifestRecorder, copied into the IPC staging buffer (publish/ipc_staging.py) and
                   exported there (CUDA IPC handles; in the dry mode the staged blocks go through torch's
                   shared memory); the other process opens them, without vLLM, and verify_tensors checks
                   every bucket's checksum over the memory it opened, and the manifest's digest;
  4 metrics        the steps' metrics are host values (floats, lists of floats), no tensor left in them
                   (on a GPU: no CUDA tensor), and they serialise to JSON.
Each part prints what it ran and its result; the last line is one JSON summary ("passed", and each
part's "ok", seconds and detail).  Exit 0 only when all four passed; else 1, the failed parts named.
--break ipc flips a byte of the exported copy after it was hashed; --break checkpoint flips a byte of a
committed checkpoint file: either must fail its part (the tests' proof that a part can fail).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

_HERE = Path(__file__).resolve()
REPO = _HERE.parents[2] if len(_HERE.parents) > 2 else _HERE.parent  # a checkout, or wherever it was copied
PARTS = ("learner_step", "checkpoint", "ipc_digest", "metrics")
BREAKS = ("ipc", "checkpoint")
TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
BATCH, WIDTH, PROMPT = 4, 16, 3  # sequences, tokens per sequence, prompt tokens (not in the loss)
SEED = 7
OPEN_TIMEOUT_S = 120.0


class PartFailed(RuntimeError):
    """A part's check did not hold; the message says which and by how much."""


def _say(text: str) -> None:
    print(text, flush=True)


def _parse(argv):
    parser = argparse.ArgumentParser(description="GPU check stage 1 (torch + megatron-core only)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (the GPU check) or cpu (the dry mode: the same logic on gloo)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="the learner's dtype (bf16 by default, on CPU too)")
    parser.add_argument("--break", dest="breaks", action="append", choices=BREAKS, default=[],
                        help="inject a fault into that part (it must then fail)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds before a hung run is ended with every thread's stack printed (exit 1)")
    return parser.parse_args(argv)


# ---- the learner ---------------------------------------------------------------------------------


def _learner(platform, dtype: str, seed: int):
    from megatron_rl.learner import Learner, LearnerConfig
    from megatron_rl.models.hf_config import load_hf_config

    cfg = LearnerConfig(global_batch_size=BATCH, micro_batch_size=2, lr=1e-3, seed=seed, dtype=dtype)
    return Learner(cfg, load_hf_config(TINY), platform)


def _batch(learner) -> dict:
    """A GRPO batch as train.batch.build_batch lays it out, on-policy (behaviour = the learner's logprobs)."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, TINY["vocab_size"], (BATCH, WIDTH), generator=gen)
    mask = torch.ones(BATCH, WIDTH - 1)
    mask[:, :PROMPT - 1] = 0.0  # predictions of prompt tokens are not in the loss
    behavior = learner.forward_logprobs(tokens).float().cpu()
    return {"tokens": tokens, "loss_mask": mask, "behavior_logprobs": behavior,
            "advantages": torch.tensor([1.0, -0.5, 0.5, -0.25]),
            "lengths": torch.full((BATCH,), WIDTH, dtype=torch.long),
            "tokens_in_loss": float(mask.sum()), "sequences_in_loss": float(BATCH)}


def _grpo_step(learner, batch: dict) -> dict:
    """One step as a learner rank takes it (ranks/rank.py _step): GRPO loss, lag-guard step hook."""
    from functools import partial

    from megatron_rl.grpo.loss import GRPOLossConfig
    from megatron_rl.grpo.micro_loss import grpo_micro_batch_loss
    from megatron_rl.grpo.step_metrics import grpo_step_weight

    cfg = GRPOLossConfig().at_step(learner.step)
    return learner.train_step(batch, partial(grpo_micro_batch_loss, cfg=cfg), partial(grpo_step_weight, cfg=cfg))


def part_learner_step(state: dict) -> str:
    import torch

    learner = state["learner"] = _learner(state["platform"], state["dtype"], SEED)
    params = learner.model[0].module.parameters()
    te = sorted({type(m).__name__ for m in learner.model[0].module.modules()  # TE's own, or Megatron's TE wrappers
                 if "transformer_engine" in type(m).__module__})
    if te:
        raise PartFailed(f"the model has Transformer Engine modules ({', '.join(te)}); stage 1 is for local layers")
    first = next(params)
    before = first.detach().clone()
    state["batch"] = _batch(learner)
    metrics = state["metrics"]["step 1"] = _grpo_step(learner, state["batch"])
    loss, grad_norm = metrics.get("loss"), metrics.get("grad_norm")
    if not (isinstance(loss, float) and math.isfinite(loss) and isinstance(grad_norm, float)
            and math.isfinite(grad_norm) and grad_norm > 0):
        raise PartFailed(f"loss {loss!r}, grad norm {grad_norm!r}: both must be finite floats (grad norm > 0)")
    if metrics.get("update_successful") != 1.0 or torch.equal(before, first.detach()):
        raise PartFailed(f"the optimizer step did not change the weights (update_successful "
                         f"{metrics.get('update_successful')})")
    return (f"{first.dtype} params on {first.device}, {sum(p.numel() for p in learner.model[0].module.parameters())} "
            f"of them; loss {loss:.6g}, grad norm {grad_norm:.4g}, lr {metrics.get('lr'):.3g}")


def part_checkpoint(state: dict) -> str:
    from megatron_rl.checkpoint import load_checkpoint, load_rng_state, resume_checkpoint, save_checkpoint
    from megatron_rl.rng_state import capture_rng_state, restore_rng_state
    from megatron_rl.ranks.weights import WeightIO
    from megatron_rl.train.restart import save_probe, shadow_forward

    learner, platform = state["learner"], state["platform"]
    run_dir = Path(state["tmp"]) / "checkpoints"
    hf_cfg = learner.hf_cfg

    def save_fn(tmp: Path) -> None:  # what Checkpointer.save writes for the learner
        WeightIO(0, learner, hf_cfg).save(str(tmp / "weights"))
        save_probe(learner, rows=2, vocab_size=hf_cfg.vocab_size, ckpt_dir=tmp)

    t0 = time.monotonic()
    path = save_checkpoint(run_dir, learner.step, policy_version=learner.step, config_hash="stage1",
                           save_fn=save_fn, tokenizer_hash="stage1", rng_states={0: capture_rng_state()})
    saved_s = time.monotonic() - t0
    # The uninterrupted learner's next two steps: the first shows the weights, the second Adam's state.
    expected = [_grpo_step(learner, state["batch"])["loss"] for _ in range(2)]
    if "checkpoint" in state["breaks"]:
        victim = sorted(p for p in (path / "weights").rglob("*") if p.is_file() and p.stat().st_size)[0]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        _say(f"   --break checkpoint: flipped a byte of {victim.relative_to(path)}")
    ckpt = resume_checkpoint(run_dir)  # the newest checkpoint whose files verify, as a resume picks it
    if ckpt is None:
        raise PartFailed(f"no checkpoint under {run_dir.name}/ verifies (resume_checkpoint found none)")
    manifest = load_checkpoint(ckpt, tokenizer_hash="stage1")  # sha256 of every file again
    step = learner.step - 2
    learner.close()
    state["learner"] = None
    fresh = state["learner"] = _learner(platform, state["dtype"], SEED + 1)  # other initial weights
    loaded_step = WeightIO(0, fresh, hf_cfg).load(str(ckpt / "weights"))
    restore_rng_state(load_rng_state(ckpt, 0))
    delta = shadow_forward(fresh, ckpt, tolerance=0.0)  # the probe's logprobs, bit for bit
    resumed = []
    for n in (step + 1, step + 2):
        metrics = state["metrics"][f"step {n} (resumed)"] = _grpo_step(fresh, state["batch"])
        resumed.append(metrics["loss"])
    if loaded_step != step or manifest["step"] != step:
        raise PartFailed(f"saved at step {step}, the manifest says {manifest['step']}, the learner loaded {loaded_step}")
    if resumed[0] != expected[0]:
        raise PartFailed(f"next step's loss after the resume {resumed[0]!r} != {expected[0]!r} without it "
                         f"(difference {resumed[0] - expected[0]:.3g})")
    # The step after depends on the restored moments and schedule.  Exact on CPU; a GPU's backward
    # (embedding gradients by atomic adds) need not be bitwise reproducible, so a relative 1e-3 there.
    tolerance = 0.0 if platform.is_cpu else 1e-3 * max(abs(expected[1]), 1e-3)
    if not abs(resumed[1] - expected[1]) <= tolerance:
        raise PartFailed(f"the second step after the resume: loss {resumed[1]!r}, without it {expected[1]!r} "
                         f"(difference {resumed[1] - expected[1]:.3g} > {tolerance:.3g}): optimizer state not restored")
    files = len(manifest["files"])
    return (f"{ckpt.name}: {files} files committed in {saved_s:.1f} s and verified (sha256); fresh learner "
            f"(seed {SEED + 1}) loaded step {loaded_step}, shadow forward max |d| {delta}, next loss "
            f"{resumed[0]:.6g} == {expected[0]:.6g}, the one after {resumed[1]:.6g} vs {expected[1]:.6g}")


# ---- the publication to a second process ---------------------------------------------------------


def _cpu_handle(view):
    """The dry mode's export: the staged view itself, which torch's multiprocessing queue hands over
    in shared memory (the block's storage moves there once; the receiver maps it, no copy)."""
    return {"cpu": view}


def _opener(device: str, inbox, outbox) -> None:
    """The second process: open every handle (no vLLM), check names, shapes, dtypes and each bucket's
    checksum over the memory it opened (verify_tensors), and answer with the manifest's digest."""
    out: dict = {"pid": os.getpid()}
    try:
        import torch

        from megatron_rl.publish.ipc_staging import open_cuda_handle
        from megatron_rl.publish.manifest import PublicationManifest, verify_tensors

        msg = inbox.get(timeout=OPEN_TIMEOUT_S)
        manifest = PublicationManifest.from_dict(msg["manifest"])
        if device == "cuda":
            torch.cuda.set_device(0)
            tensors = [open_cuda_handle(h, torch.device("cuda", 0)) for h in msg["handles"]]
        else:
            tensors = [h["cpu"] for h in msg["handles"]]
        names = [name for name, _, _ in msg["meta"]]
        problem, bucket = verify_tensors(manifest, list(zip(names, tensors)))
        out.update(problem=problem, bucket=bucket, digest=manifest.digest(), tensors=len(tensors),
                   bytes=sum(t.numel() * t.element_size() for t in tensors),
                   devices=sorted({str(t.device) for t in tensors}),
                   shared=all(t.is_cuda or t.is_shared() for t in tensors))
        del tensors
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()
    except BaseException:  # noqa: BLE001 -- reported to the exporter, which fails the part with it
        out["problem"] = "the opening process failed:\n" + traceback.format_exc(limit=4)
    outbox.put(out)


def part_ipc_digest(state: dict) -> str:
    import torch
    import torch.multiprocessing as tmp

    from megatron_rl.publish.checksum import DEFAULT_CHECKSUM, raw_bytes
    from megatron_rl.publish.ipc_route import export_ipc_handles
    from megatron_rl.publish.ipc_staging import IpcStaging
    from megatron_rl.publish.manifest import ManifestRecorder
    from megatron_rl.publish.source import MegatronWeightSource

    learner, platform, device = state["learner"], state["platform"], state["device"]
    ctx = tmp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_opener, args=(device, inbox, outbox))  # starts while the exporter works
    proc.start()
    staging = IpcStaging() if device == "cuda" else IpcStaging(_cpu_handle)
    try:
        source = MegatronWeightSource(learner.model[0].module, learner.hf_cfg, dtype=platform.dtype,
                                      device=str(platform.device))
        recorder = ManifestRecorder(source, version=learner.step, checksum_algo=DEFAULT_CHECKSUM)
        meta, handles, keep = export_ipc_handles(recorder, staging)
        manifest = recorder.manifest()
        if "ipc" in state["breaks"]:
            raw_bytes(keep[0])[:1].bitwise_xor_(0xFF)  # after hashing: the copy the other process opens differs
            _say(f"   --break ipc: flipped a byte of {meta[0][0]} in the exported copy")
        if device == "cuda":
            torch.cuda.current_stream().synchronize()  # every exported byte written before the other reads
        inbox.put({"meta": meta, "handles": handles, "manifest": manifest.to_dict()})
        try:
            answer = outbox.get(timeout=OPEN_TIMEOUT_S)
        except Exception:  # noqa: BLE001 -- queue.Empty: the opener died or hung
            raise PartFailed(f"the opening process (exit code {proc.exitcode}) did not answer within "
                             f"{OPEN_TIMEOUT_S:.0f} s") from None
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        staging.release()
        if device == "cuda":
            torch.cuda.ipc_collect()
    if answer.get("problem"):
        raise PartFailed(f"process {answer['pid']} refused the publication: {answer['problem']}")
    if answer["digest"] != manifest.digest():
        raise PartFailed(f"manifest digest {answer['digest']} opened != {manifest.digest()} exported")
    if answer["pid"] == os.getpid() or not answer["shared"]:
        raise PartFailed(f"the tensors were not opened from shared memory in another process ({answer})")
    if answer["tensors"] != len(meta) or answer["bytes"] != manifest.nbytes:
        raise PartFailed(f"opened {answer['tensors']} tensors, {answer['bytes']} bytes; exported {len(meta)}, "
                         f"{manifest.nbytes}")
    way = "CUDA IPC handles" if device == "cuda" else "shared memory"
    return (f"{len(meta)} tensors, {manifest.nbytes} bytes in {len(manifest.buckets)} bucket(s), exported from the "
            f"staging buffer over {way} to process {answer['pid']} ({', '.join(answer['devices'])}); every "
            f"{manifest.checksum_algo} checksum and digest {manifest.digest()[:16]} matched there")


# ---- metric devices ------------------------------------------------------------------------------


def part_metrics(state: dict) -> str:
    import torch

    if not state["metrics"]:
        raise PartFailed("no step's metrics to check (part 1 did not step)")
    problems, count = [], 0
    for step, metrics in state["metrics"].items():
        for key, value in metrics.items():
            count += 1
            values = value if isinstance(value, (list, tuple)) else [value]
            for v in values:
                if isinstance(v, torch.Tensor):
                    problems.append(f"{step}: {key} is a tensor on {v.device}")
                    break
                if not isinstance(v, (float, int)):
                    problems.append(f"{step}: {key} is a {type(v).__name__}")
                    break
        try:
            json.dumps(metrics)
        except TypeError as err:
            problems.append(f"{step}: not JSON ({err})")
    if problems:
        raise PartFailed("; ".join(problems))
    return f"{count} metrics of {len(state['metrics'])} steps are host floats (or lists of them), JSON-serialisable"


# ---- the run -------------------------------------------------------------------------------------

DESCRIBE = {
    "learner_step": "{dtype} learner step, local layers",
    "checkpoint": "driver-level checkpoint save, load into a fresh learner, identical next loss",
    "ipc_digest": "two-process export, open and digest check (no vLLM)",
    "metrics": "metric devices: host floats only",
}
RUN = {"learner_step": part_learner_step, "checkpoint": part_checkpoint, "ipc_digest": part_ipc_digest,
       "metrics": part_metrics}
NEEDS = {"checkpoint": "learner", "ipc_digest": "learner"}  # a part that needs a live learner


def _run_parts(state: dict, summary: dict) -> None:
    """Each part in order, printed as it ends; a part that needs a learner is not run without one."""
    from megatron_rl.config import ConfigError

    for n, name in enumerate(PARTS, 1):
        title = f"== stage 1 part {n}/{len(PARTS)} {name}: {DESCRIBE[name].format(dtype=state['dtype'])}"
        if NEEDS.get(name) == "learner" and state["learner"] is None:
            summary["parts"][name] = {"ok": False, "seconds": 0.0, "detail": "not run: no learner (part 1 failed)"}
            _say(f"{title}: FAILED, not run (no learner: part 1 failed)")
            continue
        t0 = time.monotonic()
        try:
            detail, ok = RUN[name](state), True
        except PartFailed as err:
            detail, ok = str(err), False
        except ConfigError as err:  # a refusal that names its cause (a checkpoint that does not verify)
            detail, ok = f"{type(err).__name__}: {err}", False
        except Exception as err:  # noqa: BLE001 -- the part failed; the rest still runs where it can
            detail, ok = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=6)}", False
        seconds = round(time.monotonic() - t0, 2)
        summary["parts"][name] = {"ok": ok, "seconds": seconds, "detail": detail}
        _say(f"{title}: {'passed' if ok else 'FAILED'} ({seconds} s)\n   {detail}")


def _refuse(summary: dict, error: str, hint: str = "") -> int:
    summary["error"] = error
    _say(f"stage 1: FAILED: {error}{hint}")
    _say(json.dumps(summary))
    return 1


def main(argv=None) -> int:
    args = _parse(argv)
    start = time.monotonic()
    faulthandler.dump_traceback_later(args.timeout, exit=True)  # a hang (a collective, an IPC open) ends here
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the dry mode hides the GPUs before torch looks
    if str(REPO) not in sys.path and (REPO / "megatron_rl").is_dir():
        sys.path.insert(0, str(REPO))  # a checkout run as `python tests/gpu/stage1.py` (else: the installed wheel)
    summary: dict = {"stage": 1, "device": args.device, "dtype": args.dtype, "breaks": args.breaks, "passed": False,
                     "parts": {}}
    state: dict = {"device": args.device, "dtype": args.dtype, "breaks": args.breaks, "metrics": {}, "learner": None}
    try:
        import torch
        import torch.distributed as dist

        from megatron_rl.platform import detect_platform
        from megatron_rl.platform.parallel import init_distributed
        from megatron_rl.platform.spawn import free_port
        from megatron_rl.ranks.build import seed_everything
    except Exception as err:  # noqa: BLE001 -- one clear line and the summary, not a traceback
        return _refuse(summary, f"imports failed: {err!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        return _refuse(summary, "--device cuda but torch sees no GPU", " (the CPU dry mode: --device cpu)")
    seed_everything(SEED, None, threads=2 if args.device == "cpu" else torch.get_num_threads())
    platform = state["platform"] = dataclasses.replace(detect_platform(args.device, args.dtype), use_te=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), LOCAL_RANK="0")
    init_distributed(platform, rank=0, world_size=1)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none (dry mode)"
    _say(f"== stage 1 (torch {torch.__version__}, {platform.backend} on {platform.device}, {args.dtype}, "
         f"local layers, GPU: {gpu})")
    with tempfile.TemporaryDirectory(prefix="stage1-") as tmp:
        state["tmp"] = tmp
        _run_parts(state, summary)
        if state["learner"] is not None:
            state["learner"].close()
    dist.destroy_process_group()
    failed = summary["failed"] = [name for name, part in summary["parts"].items() if not part["ok"]]
    summary["passed"] = not failed and len(summary["parts"]) == len(PARTS)
    summary["seconds"] = round(time.monotonic() - start, 2)
    verdict = "passed" if summary["passed"] else f"FAILED: {', '.join(failed)}"
    _say(f"== stage 1 {verdict} ({summary['seconds']} s)")
    _say(json.dumps(summary))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
