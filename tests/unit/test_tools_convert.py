"""tools/convert.py is `megatron-rl convert` from a checkout: same parser, errors and exit codes.

    python -m pytest tests/unit/test_tools_convert.py -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_the_tool_is_the_cli(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert.py"), "mcore-to-hf", "--mcore",
                           str(tmp_path / "missing"), "--out", str(tmp_path / "hf")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "megatron-rl convert: error: Megatron checkpoint directory not found" in proc.stderr
