"""Per-token provenance (issue 27): each token's version is read back from vLLM's weights labels,
and a trajectory's digests must match what the learner published.

    python -m pytest tests/unit/test_provenance.py -q

The spans have the fields of vLLM's WeightVersionSpan (version, start, end); the real engine path
is exercised end to end (tests/e2e/test_train.py: every trajectory of run A carries its digests).
"""

from __future__ import annotations

from collections import namedtuple

import pytest

from megatron_rl.publish.manifest import PublicationManifest, pack_bucket
from megatron_rl.rollout.provenance import UNSERVED, parse_label, token_provenance, weights_label
from megatron_rl.train.policy import quarantine
from megatron_rl.trajectory import Trajectory, make_trajectory

pytestmark = pytest.mark.unit

WeightVersionSpan = namedtuple("WeightVersionSpan", "version start end")  # vllm.outputs' fields


def test_labels_name_version_and_digest():
    assert weights_label(7, "ab12") == "7:ab12" and parse_label("7:ab12") == (7, "ab12")
    assert weights_label(0, None) == "0:disk" and weights_label(None, "x") == UNSERVED
    with pytest.raises(ValueError, match="not '<version>:<digest>'"):
        parse_label(UNSERVED)


def test_tokens_take_the_version_of_the_label_that_sampled_them():
    spans = [WeightVersionSpan("3:cafe", 0, 5)]
    assert token_provenance(spans, 5, "3:cafe") == ([3] * 5, {"3": "cafe"})
    assert token_provenance([], 0, "3:cafe") == ([], {})


@pytest.mark.parametrize("spans,why", [
    ([WeightVersionSpan("2:beef", 0, 5)], "labelled '2:beef'"),                                # other weights
    ([WeightVersionSpan("3:cafe", 0, 2), WeightVersionSpan("4:f00d", 2, 5)], "labelled '4:f00d'"),  # a switch
    ([WeightVersionSpan("3:cafe", 0, 4)], "cover 4 of 5"),                                    # a gap at the end
    (None, "no weights label"),
])
def test_a_token_from_other_weights_is_an_error_naming_it(spans, why):
    with pytest.raises(RuntimeError, match=why):
        token_provenance(spans, 5, "3:cafe")


def _traj(weights: dict) -> Trajectory:
    return make_trajectory(id="r1/p0/0", prompt_id="p0", dataset_version="d", policy_versions=[3, 3],
                           tokenizer_hash="t", prompt_tokens=[1], response_tokens=[5, 6], behavior_logprobs=[-1.0, -2.0],
                           grader_version="g", terminal_reason="stop", rollout_started_at=0.0, scored_at=1.0,
                           weights=weights)


def test_tokens_from_bytes_the_policy_never_published_are_quarantined_not_trained():
    from megatron_rl.grpo.loss import GRPOLossConfig
    from megatron_rl.train.batch import build_batch

    good, unknown, forged = _traj({"3": "cafe"}), _traj({"4": "cafe"}), _traj({"3": "beef"})
    kept, n = quarantine([good, unknown, forged], {"3": "cafe"})  # version 4: before this process, passes
    assert n == 1 and [t.status for t in kept] == ["ok", "ok", "quarantined"]
    assert "digest beef, but the learner published version 3 as cafe" in kept[2].error_code
    assert kept[2].reward is None and not kept[2].in_loss
    batch, stats = build_batch(kept, pad_id=0, loss_cfg=GRPOLossConfig(), micro_batch_size=1)
    assert batch["tokens"].shape[0] == 3  # the batch keeps its shape ...
    assert batch["loss_mask"][2].sum() == 0 and stats["invalid_samples"] == 1.0  # ... the forged row is out


def test_digests_travel_with_the_trajectory_and_old_checksums_hold():
    t = _traj({"3": "cafe"})
    assert Trajectory.from_bytes(t.to_bytes()).weights == {"3": "cafe"}
    assert _traj({"3": "beef"}).checksum != t.checksum  # part of the checked content
    plain = _traj({})
    assert '"weights"' not in plain.to_bytes().decode("latin-1")  # a trajectory without provenance: as before


def test_the_manifest_digest_is_its_layout_and_checksums():
    import torch

    b, _ = pack_bucket(0, [("w", torch.ones(4))], "blocksum")
    c, _ = pack_bucket(0, [("w", torch.zeros(4))], "blocksum")
    m = PublicationManifest(1, "blocksum", (b,))
    assert m.digest() == PublicationManifest(2, "blocksum", (b,)).digest()  # the bytes, not the version number
    assert m.digest() != PublicationManifest(1, "blocksum", (c,)).digest()
    assert len(m.digest()) == 16
