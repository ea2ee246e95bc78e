"""The logits comparison of the parallel-equivalence test fails on a shape mismatch (it used to
skip the comparison silently) and on differing values.

    python -m pytest tests/unit/test_logits_comparison.py -q
"""

import pytest
import torch

from tests.reference import assert_same_logits

pytestmark = pytest.mark.unit


def test_same_logits_pass():
    x = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    assert_same_logits(x, x.clone(), "tp2pp1")


def test_a_shape_mismatch_fails():
    x = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match="shape"):
        assert_same_logits(x[..., :10], x, "tp2pp1")  # e.g. a padded vocabulary sliced wrongly


def test_differing_values_fail():
    x = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match="tp2pp1"):
        assert_same_logits(x + 1e-3, x, "tp2pp1")
