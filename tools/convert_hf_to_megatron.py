"""Convert a Hugging Face Llama / Qwen2 checkpoint into a Megatron-Core distributed checkpoint.

    python tools/convert_hf_to_megatron.py --hf MODEL_DIR --out MCORE_DIR --tp 2 --pp 2 [--dtype bf16]

Same as `megatron-rl convert hf-to-mcore`; see megatron_rl/conversion/hf_to_mcore.py.
"""

import argparse
import logging
import sys

from megatron_rl.conversion.cli import add_hf_to_mcore_args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_hf_to_mcore_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
