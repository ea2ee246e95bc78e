"""Every test under tests/unit is in the fast tier (`python -m pytest -m unit`, under 2 minutes)
except those marked `slow`: a fresh Python process importing Megatron (10-20 s each), which the
full suite runs.

A file that forgets `pytestmark = pytest.mark.unit` is marked here, so the tier never silently
loses tests; what starts vLLM, Ray clusters or several Megatron processes belongs in tests/e2e or
tests/dist instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.unit)
