"""The fault drills whose faults are armed while requests are in flight (issue #12), through the real
`megatron-rl drill` CLI on the tiny recipe; the drills that read no timing are in test_drills.py.

    python -m pytest tests/e2e/test_drills_in_flight.py -q

engine_crash and engine_crash_publish share one run (`megatron-rl drill together`: the engine core dies while
generating round 1, then again as publication 2 begins: two engine restarts of ~30 s); partition (two rollout
groups, one SIGSTOPped past rollout.publish_timeout_s, 12 short steps); refit_stale_kv (streaming: the
stale-cache bug injected, caught by the audit); refit_engine_death (streaming: the engine core killed paused in
a refit).  Every test here runs alone (tests/lanes.py): what the fault hits depends on timing, which another
run beside it would change.  A module of its own, so that test_drills.py's runs, which read no timing, may run
beside other modules.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import drill, drills_together, protocol_kept

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ALONE = pytest.mark.alone("the fault is armed while requests are in flight, and the drill asserts what they did")


@pytest.fixture(scope="module")
def engine_crashes(tmp_path_factory):
    """The engine core killed while generating round 1, then again as publication 2 begins: one run."""
    return drills_together(tmp_path_factory, ("engine_crash", "engine_crash_publish"), "--at-step", "1",
                           "--steps", "3")


@ALONE
def test_engine_crash_restarts_refits_and_retries(engine_crashes):
    code, records = engine_crashes
    rec = records["engine_crash"]
    assert code == 0 and rec["recovered"], rec
    assert [a["exit"] for a in rec["attempts"]] == [0], rec  # recovered inside the run, no rerun
    assert rec["injected_at"]["requests_in_flight"] > 0, rec  # killed mid-generation
    assert "vLLM engine died during generation" in rec["evidence"], rec
    assert "rollout group 0 refitted: serving policy version 1" in rec["refit"], rec  # the version round 1 needs
    assert "refit check passed" in rec["refit"], rec
    # one restart per death (this run's second death is engine_crash_publish's); 8 prompts of round 1 retried
    assert rec["engine_restarts"] == 2.0 and rec["requests_retried"] == 8.0, rec
    assert rec["samples_off_version"] == 0, rec  # no sample of the restarted engine's disk weights
    protocol_kept(rec, redone=0)


@ALONE
def test_engine_crash_during_publication_restarts_and_refits(engine_crashes):
    """Issue 30 defect 6: an engine-core SIGKILL as publication 2 begins takes the restart path of a
    death during generation (group restarted stale, the version published again), not a traceback."""
    code, records = engine_crashes
    rec = records["engine_crash_publish"]
    assert code == 0 and rec["recovered"], rec
    assert [a["exit"] for a in rec["attempts"]] == [0], rec  # recovered inside the run, no rerun
    assert "vLLM engine died during publication" in rec["evidence"], rec
    assert "rollout group 0 refitted: serving policy version 2" in rec["refit"], rec
    assert rec["engine_restarts"] == 2.0 and rec["samples_off_version"] == 0, rec  # one restart per death
    protocol_kept(rec, redone=0)


@ALONE
def test_partition_leaves_a_stopped_group_out_and_refits_it(tmp_path_factory):
    # Two rollout groups; one SIGSTOPped for 15 s at publication 2 (rollout.publish_timeout_s 6 s).
    code, rec = drill(tmp_path_factory, "partition", "--at-step", "1", "--steps", "12")
    assert code == 0 and rec["recovered"], rec
    assert [a["exit"] for a in rec["attempts"]] == [0], rec  # recovered inside the run
    assert "did not answer the publication of version 2 within rollout.publish_timeout_s=6 s" in rec["evidence"]
    assert rec["steps_while_unreachable"] >= 1 and rec["partitions"] == 1.0, rec  # the other group went on
    assert "answers again" in rec["returned"], rec
    assert "refitted: serving policy version" in rec["refit"] and "refit check passed" in rec["refit"], rec
    assert rec["samples_off_version"] == 0, rec  # nothing of the stopped group's old version reached the queue
    protocol_kept(rec, redone=0)




@ALONE
def test_a_stale_kv_refit_is_caught_by_the_audit(tmp_path_factory):
    # Streaming, in-flight refits (drill/streaming.py): from publication 2 on, a recompute refit skips the KV
    # invalidation and says it happened (the stale-cache bug), so kept requests attend to the old weights' KV
    # while their tokens are labelled recomputed.  audit.every=1 re-scores them under their version: exit 89.
    # 6 steps: a refit keeps requests only when one lands while the engine generates, which timing decides (a
    # CI run under load saw refits 2 and 3 keep none and 4 -- after the last step -- keep 8); each later refit
    # is another chance, and a sequence on stale KV must still be trained (and so audited) before the end.
    code, rec = drill(tmp_path_factory, "refit_stale_kv", "--at-step", "1", "--steps", "6")
    assert code == 0 and rec["recovered"], rec
    assert rec["injected_at"]["requests_kept_on_stale_kv"] > 0, rec  # the bug did hit requests in flight
    assert [a["exit"] for a in rec["attempts"]] == [89], rec
    assert rec["evidence"].startswith("sequence ") and "recompute): max |Δ|" in rec["evidence"], rec
    assert rec["trajectories_lost"] == 0 and rec["trajectories_duplicated"] == 0, rec



@ALONE
def test_an_engine_dying_paused_in_a_refit_is_restarted_and_its_requests_sent_again(tmp_path_factory):
    # Streaming: the first refit to version 2 or later that keeps requests SIGKILLs the engine core while
    # generation is paused, before the new weights load (drill/streaming.py).  The publication is refused, the
    # requests die with the engine; the group is restarted stale, the version published again (its refit),
    # the kept requests' prompt groups sent again -- and the run finishes in the same attempt.
    code, rec = drill(tmp_path_factory, "refit_engine_death", "--at-step", "1", "--steps", "5")
    assert code == 0 and rec["recovered"], rec
    assert rec["injected_at"]["requests_kept"] > 0 and rec["engine_restarts"] == 1.0, rec
    assert [a["exit"] for a in rec["attempts"]] == [0], rec
    assert rec["refit"].startswith("refitted: serving policy version"), rec
    assert rec["quarantined_trajectories"] == 0, rec
    assert rec["trajectories_lost"] == 0 and rec["trajectories_duplicated"] == 0 and rec["versions_continuous"], rec
