"""`megatron-rl make-tiny-model`: a small random HF checkpoint with a char tokenizer (no network).

    megatron-rl make-tiny-model --arch llama --out /tmp/tiny    # prints the directory and its tokenizer sha256
"""

from __future__ import annotations

import argparse

from megatron_rl.models.tiny import ARCHS, DEFAULT_VOCAB_SIZE, SIZES, make_tiny_model
from megatron_rl.models.tokenizer import tokenizer_hash


def _cmd(args: argparse.Namespace) -> int:
    path = make_tiny_model(
        args.out,
        arch=args.arch,
        size=args.size,
        seed=args.seed,
        tie_embeddings=args.tie_embeddings,
        force=args.force,
        vocab_size=args.vocab_size,
    )
    print(f"{path}  tokenizer sha256 {tokenizer_hash(path)}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("make-tiny-model", help="write a small random HF checkpoint + char tokenizer (no network)")
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty, unless --force)")
    p.add_argument("--size", choices=list(SIZES), default="tiny",
                   help="tiny ~0.4M, mini ~2.9M, small ~24M, medium ~283M, medium_half ~142M params "
                        "(qwen3_moe: medium ~604M, medium_half ~302M)")
    p.add_argument("--seed", type=int, default=0, help="init seed; same seed -> identical weights")
    p.add_argument("--tie-embeddings", action="store_true", help="share input embedding and LM head")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="embedding rows (>= tokenizer size)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    p.set_defaults(func=_cmd)
