"""`megatron-rl convert`, for a checkout without the package installed as a command.

    python tools/convert.py hf-to-mcore --hf MODEL_DIR --out MCORE_DIR --tp 2 --pp 2 [--dtype bf16]
    python tools/convert.py mcore-to-hf --mcore MCORE_DIR --out HF_DIR [--dtype fp32]
    python tools/convert.py verify --hf MODEL_DIR --mcore MCORE_DIR

One entry point, the CLI's own (megatron_rl/conversion/cli.py): same arguments, errors and exit codes.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
