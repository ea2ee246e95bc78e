"""`megatron-rl convert ...`: HF <-> Megatron-Core checkpoint conversion and its numeric check.

    megatron-rl convert hf-to-mcore --hf MODEL_DIR --out MCORE_DIR --tp 2 --pp 2 [--dtype bf16] [--force]
    megatron-rl convert mcore-to-hf --mcore MCORE_DIR --out HF_DIR [--dtype fp32] [--force]
    megatron-rl convert lora-export --mcore RUN_DIR/checkpoints/step_N --out ADAPTER_DIR [--merged HF_DIR]
        [--base MODEL_DIR] [--dtype bf16] [--force]     # a LoRA run's adapters: PEFT layout and/or merged
    megatron-rl convert verify --hf MODEL_DIR --mcore MCORE_DIR [--tp N --pp N --ep N]   # one JSON line
        exit 1 when max |Δlogit| > --tolerance (default by stored dtype: fp32 1e-3, bf16 1.0, fp16 0.25)

tools/convert.py runs the same command from a checkout.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_rl.config import ConfigError

DTYPES = ("fp32", "bf16", "fp16")


def add_hf_to_mcore_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf", required=True, help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--out", required=True, help="Megatron output directory (must not exist, unless --force)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size to convert at (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size to convert at (default 1)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="stored dtype (default fp32)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory once done")
    p.set_defaults(func=_hf_to_mcore)


def add_mcore_to_hf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mcore", required=True,
                   help="Megatron directory written by hf-to-mcore, or a committed training checkpoint "
                        "(RUN_DIR/checkpoints/step_N)")
    p.add_argument("--out", required=True, help="HF output directory (must not exist, unless --force)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="output dtype (default: the source's)")
    p.add_argument("--max-shard-gb", type=float, default=4.0, help="safetensors shard size limit (default 4)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory once done")
    p.set_defaults(func=_mcore_to_hf)


def _hf_to_mcore(args: argparse.Namespace) -> int:
    from megatron_rl.conversion.hf_to_mcore import convert_hf_to_mcore

    out = convert_hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype, force=args.force)
    print(out)
    return 0


def _mcore_to_hf(args: argparse.Namespace) -> int:
    from megatron_rl.conversion.mcore_to_hf import convert_mcore_to_hf

    if args.max_shard_gb <= 0:
        raise ConfigError(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    out = convert_mcore_to_hf(args.mcore, args.out, dtype=args.dtype, force=args.force,
                              max_shard_bytes=int(args.max_shard_gb * (1 << 30)))
    print(out)
    return 0


def add_lora_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mcore", required=True, help="a committed checkpoint of a LoRA run (RUN_DIR/checkpoints/step_N)")
    p.add_argument("--out", default=None,
                   help="PEFT adapter directory to write (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--merged", default=None, help="also (or only) write the base with the adapters merged in, "
                                                  "as a full HF model directory")
    p.add_argument("--base", default=None, help="the base model's HF directory (default: the one the run started "
                                                "from); its digest must be the checkpoint's")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="merged model's dtype (default: the base's)")
    p.add_argument("--force", action="store_true", help="replace existing output directories once done")
    p.set_defaults(func=_lora_export)


def _lora_export(args: argparse.Namespace) -> int:
    from megatron_rl.conversion.hf_to_mcore import TORCH_DTYPES
    from megatron_rl.conversion.lora_io import export_lora_checkpoint

    if args.out is None and args.merged is None:
        raise ConfigError("convert lora-export: give --out (PEFT adapter), --merged (full HF model) or both")
    for path in export_lora_checkpoint(args.mcore, args.out, merged=args.merged, base=args.base,
                                       dtype=TORCH_DTYPES[args.dtype] if args.dtype else None, force=args.force):
        print(path)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from megatron_rl.conversion.verify import verify_conversion

    if args.batch < 1 or args.seq_len < 1:
        raise ConfigError(f"--batch and --seq-len must be positive, got {args.batch}, {args.seq_len}")
    if args.tolerance is not None and not args.tolerance >= 0:
        raise ConfigError(f"--tolerance must be >= 0, got {args.tolerance}")
    report = verify_conversion(args.hf, args.mcore, tp=args.tp, pp=args.pp, ep=args.ep, seed=args.seed,
                               batch=args.batch, seq_len=args.seq_len, tolerance=args.tolerance)
    print(json.dumps(report))
    if not report["ok"]:
        print(f"megatron-rl convert verify: FAILED: max |logit difference| {report['max_abs_diff']:.3g} exceeds "
              f"the tolerance {report['tolerance']:g} (argmax agreement {report['argmax_agreement']:.2f}): "
              f"{args.mcore} does not compute what {args.hf} computes", file=sys.stderr)
        return 1
    return 0


def register(subparsers) -> None:
    conv = subparsers.add_parser("convert", help="convert checkpoints between Hugging Face and Megatron-Core")
    sub = conv.add_subparsers(dest="convert_command", metavar="WHAT", required=True)
    add_hf_to_mcore_args(sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron-Core distributed checkpoint"))
    add_mcore_to_hf_args(sub.add_parser("mcore-to-hf", help="Megatron-Core distributed checkpoint -> HF safetensors"))
    add_lora_export_args(sub.add_parser("lora-export", help="a LoRA checkpoint's adapters -> PEFT directory "
                                                            "and/or a merged full HF model"))
    v = sub.add_parser("verify", help="compare transformers and Megatron logits on the same tokens (one JSON line)")
    v.add_argument("--hf", required=True, help="Hugging Face model directory")
    v.add_argument("--mcore", required=True, help="Megatron directory written by hf-to-mcore")
    v.add_argument("--tp", type=int, default=1, help="load the Megatron model at this TP (default 1)")
    v.add_argument("--pp", type=int, default=1, help="load the Megatron model at this PP (default 1)")
    v.add_argument("--ep", type=int, default=1, help="load a MoE model at this expert parallel size (default 1)")
    v.add_argument("--batch", type=int, default=2, help="sequences of random tokens (default 2)")
    v.add_argument("--seq-len", type=int, default=16, help="tokens per sequence (default 16)")
    v.add_argument("--seed", type=int, default=0, help="token sampling seed")
    v.add_argument("--tolerance", type=float, default=None,
                   help="exit 1 when max_abs_diff exceeds this (default by the stored dtype: "
                        "fp32 1e-3, bf16 1.0, fp16 0.25)")
    v.set_defaults(func=_verify)
