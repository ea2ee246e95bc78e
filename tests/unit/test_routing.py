"""The compact routing record a trajectory carries, and the mismatch metric's errors (pure tensors).

    python -m pytest tests/unit/test_routing.py -q
"""

import pytest
import torch

from megatron_rl.models.routing import decode_routing, encode_routing, routing_mismatch

pytestmark = pytest.mark.unit


def test_routing_record_roundtrip_and_errors():
    experts = torch.randint(0, 8, (5, 2, 2))  # [T, L, k]
    blob = encode_routing(experts.numpy())
    assert blob["dtype"] == "uint8" and len(blob["data"]) == 2 * experts.numel()
    assert (decode_routing(blob) == experts.numpy()).all()
    assert decode_routing(encode_routing(experts.numpy() + 300)).max() >= 300  # wide expert counts: uint16
    with pytest.raises(ValueError, match="data"):
        decode_routing({"shape": [1], "dtype": "uint8"})
    with pytest.raises(ValueError, match="needs 20"):
        decode_routing(dict(blob, shape=[5, 2, 2, 1, 2]) | {"shape": [5, 4, 1]} | {"data": blob["data"][:-2]})
    with pytest.raises(ValueError, match="different shapes"):
        routing_mismatch(torch.zeros(1, 2, 1, 2), torch.zeros(1, 3, 1, 2))
