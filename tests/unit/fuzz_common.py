"""Shared pieces of the fuzz tests (hypothesis): bounded settings and JSON-like values.

Every fuzz test states the one error type its parser documents; any other exception, or an
example slower than the deadline (a hang), fails the test with the input that caused it.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Part of the unit tier: few examples, a per-example deadline (5 s, generous for a loaded 2-core
# machine; examples take milliseconds) that catches a hang.
FUZZ = settings(max_examples=150, deadline=5000, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.data_too_large])

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


def mutate(blob: bytes, data) -> bytes:
    """One random damage to `blob`: a flipped byte, a truncation, an insertion or a splice."""
    kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "overwrite"]))
    if not blob:
        return data.draw(st.binary(max_size=64))
    at = data.draw(st.integers(0, len(blob) - 1))
    if kind == "flip":
        return blob[:at] + bytes([blob[at] ^ data.draw(st.integers(1, 255))]) + blob[at + 1:]
    if kind == "truncate":
        return blob[:at]
    if kind == "insert":
        return blob[:at] + data.draw(st.binary(min_size=1, max_size=16)) + blob[at:]
    chunk = data.draw(st.binary(min_size=1, max_size=16))
    return blob[:at] + chunk + blob[at + len(chunk):]
