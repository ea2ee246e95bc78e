"""What the queue remembers of trajectories that left it: finished ids and the recent take batches.

    ledger = Ledger(take_replay_window=8)
    ledger.record([(id, seq, min_version, "consumed" | "dropped", reason, request_id, checksum), ...])
    ledger.outcome(id)            # "consumed", "dropped/<reason>" or None
    ledger.checksum(id)           # the checksum it finished with (None if not recorded), False if unknown
    ledger.remember_take("step-12", batch); ledger.replay("step-12")   # the same batch again
    ledger.forget(floor=version - max_version_lag)                     # compaction

Finished ids let a re-sent trajectory be told apart (same checksum: duplicate; other: conflict).
Compaction forgets ids whose oldest policy version is below `floor`, except the ids of the takes
kept for replay: the log keeps their rows, and forgetting one let a re-send write a new `done`
row over it, so a restart saw its payload as queued again.  Rows are recorded only once the log
committed them (the queue's `_commit`), so nothing here needs undoing when a commit fails.
"""

from __future__ import annotations

import collections
from typing import Iterable

from megatron_rl.trajectory import Trajectory


def outcome_label(outcome: str, reason: str) -> str:
    """What `outcome()` says of a finished id: 'consumed' or 'dropped/<reason>'."""
    return "consumed" if outcome == "consumed" else f"dropped/{reason}"


class Ledger:
    def __init__(self, *, take_replay_window: int):
        self.take_replay_window = take_replay_window
        self._done: dict[str, tuple] = {}  # finished id -> (oldest policy version, outcome label, checksum)
        self._takes: collections.OrderedDict[str, list] = collections.OrderedDict()  # request id -> batch

    def record(self, finished: Iterable[tuple]) -> None:
        """Committed `done` rows: (id, seq, min_version, outcome, reason, request_id, checksum)."""
        for tid, _, min_version, outcome, reason, _, checksum in finished:
            self._done[tid] = (min_version, outcome_label(outcome, reason), checksum)

    def load(self, done: dict) -> None:
        """The log's `done` table: id -> (min_version, outcome, reason, checksum)."""
        self._done = {tid: (v, outcome_label(outcome, reason), checksum)
                      for tid, (v, outcome, reason, checksum) in done.items()}

    def outcome(self, tid: str) -> str | None:
        done = self._done.get(tid)
        return None if done is None else done[1]

    def checksum(self, tid: str) -> str | None | bool:
        """The checksum a finished id was offered with (None if not recorded); False if unknown."""
        done = self._done.get(tid)
        return False if done is None else done[2]

    def remember_take(self, request_id: str, batch: list[Trajectory]) -> None:
        self._takes[request_id] = batch
        while len(self._takes) > self.take_replay_window:
            self._takes.popitem(last=False)

    def replay(self, request_id: str | None) -> list[Trajectory] | None:
        """The batch an earlier take with this request id returned, if it is still kept."""
        if request_id is None or request_id not in self._takes:
            return None
        return list(self._takes[request_id])

    def forget(self, *, floor: int) -> None:
        """Forget finished ids whose oldest version is below `floor`, keeping those of replayable takes."""
        replayable = {t.id for batch in self._takes.values() for t in batch}
        self._done = {tid: done for tid, done in self._done.items() if done[0] >= floor or tid in replayable}
