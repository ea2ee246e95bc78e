"""`convert verify` fails by default past the documented tolerance (issue #12).

    python -m pytest tests/e2e/test_verify_tolerance.py -q

A tiny Llama converted to Megatron (fp32) verifies against itself (exit 0, "ok": true) and
fails against an unrelated tiny Llama (another seed) without any --tolerance (exit 1, a
FAILED line); an explicit --tolerance still overrides the default.
"""

from __future__ import annotations

import json

import pytest

from megatron_rl.conversion.verify import DEFAULT_TOLERANCE
from megatron_rl.models.tiny import make_tiny_model
from tests.e2e.conftest import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_verify_fails_by_default_for_an_unrelated_model(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", arch="llama", seed=5)
    other = make_tiny_model(tmp_path / "other", arch="llama", seed=6)
    mc = tmp_path / "mc"
    run_cli("convert", "hf-to-mcore", "--hf", str(hf), "--out", str(mc))

    same = run_cli("convert", "verify", "--hf", str(hf), "--mcore", str(mc))
    report = json.loads(same.stdout.strip().splitlines()[-1])
    assert report["ok"] is True and report["tolerance"] == DEFAULT_TOLERANCE["fp32"]
    assert report["max_abs_diff"] < DEFAULT_TOLERANCE["fp32"] / 10  # margin

    wrong = run_cli("convert", "verify", "--hf", str(other), "--mcore", str(mc), check=False)
    report = json.loads(wrong.stdout.strip().splitlines()[-1])
    assert wrong.returncode == 1 and report["ok"] is False
    assert "FAILED" in wrong.stderr and "tolerance" in wrong.stderr

    loose = run_cli("convert", "verify", "--hf", str(other), "--mcore", str(mc), "--tolerance", "1000", check=False)
    assert loose.returncode == 0
