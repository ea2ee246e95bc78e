"""Convert a Megatron directory written by hf-to-mcore back into a Hugging Face checkpoint.

    python tools/convert_megatron_to_hf.py --mcore MCORE_DIR --out HF_DIR [--dtype fp32]

Same as `megatron-rl convert mcore-to-hf`; see megatron_rl/conversion/mcore_to_hf.py.
"""

import argparse
import logging
import sys

from megatron_rl.conversion.cli import add_mcore_to_hf_args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mcore_to_hf_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
