"""Placement answers shared by the PlexRL modes of one `simulate` call: exact memoisation.

`Placer.place` is deterministic: its answer depends only on the placer's configuration, the
state its earlier operations left (every place, with its profile and time, every measured
inflation it was told of, and every release, in order) and the call's arguments. Modes that ask the same questions in the same order (the
request policies, until a job ends at a different time in one of them) get the same answers,
so `MemoPlacer` asks its placer once per (configuration, history, profile, time) and replays
the answer in the other modes, making exactly the state change the placer would have made:
`decide` advances the horizon, and a `Placement` is committed. The key is the whole history,
so a replayed answer is always the one the placer would give (tested against fresh placers).
The decisions still come from `plexrl.policy`; only repeated questions are not asked twice.
"""

from __future__ import annotations

from plexrl.policy.placement import Placement, Placer, Wait
from plexrl.policy.profile import JobProfile


class PlacementMemo:
    """Answers of every placer of one workload on one cluster, by question and history."""

    def __init__(self) -> None:
        self.answers: dict[tuple, Placement | Wait] = {}  # (history id, profile, time) -> answer
        self.asked = 0  # questions the placers answered themselves (the rest were replayed)
        self._histories: dict[tuple, int] = {}  # (parent history id, operation) -> history id

    def history(self, parent: int, operation: tuple) -> int:
        """The id of history `parent` followed by `operation`: equal ids, equal histories (by
        induction), so a key stays flat however long the history grows (a nested tuple would
        be compared recursively, past Python's recursion limit on long runs)."""
        return self._histories.setdefault((parent, operation), len(self._histories))


class MemoPlacer:
    """A `Placer` (what `AdmissionQueue` calls of it) answering from `memo` when it was asked
    the same question in the same state before."""

    def __init__(self, placer: Placer, memo: PlacementMemo):
        self.placer, self.memo = placer, memo
        view, horizon = placer.view, placer.horizon
        self._history = memo.history(-1, (type(placer).__name__, placer.max_shifts, placer.pack_limit, placer.pack_first,
                                          placer.by_effect,
                                          horizon.slots, horizon.slot_s,
                                          tuple(g.name for g in view.groups), len(view.row_device)))

    def place(self, profile: JobProfile, now: float) -> Placement | Wait:
        key = (self._history, profile, now)
        answer = self.memo.answers.get(key)
        if answer is None:
            answer = self.memo.answers[key] = self.placer.place(profile, now)
            self.memo.asked += 1
        else:  # what `place` would have changed: `decide` advances the horizon, a placement is held
            self.placer.horizon.advance(now)
            if isinstance(answer, Placement):
                self.placer.commit(profile, answer, now)
        self._history = self.memo.history(self._history, ("place", profile, now))
        return answer

    def observe(self, job: str, inflation: float) -> None:
        self.placer.observe(job, inflation)
        self._history = self.memo.history(self._history, ("observe", job, inflation))

    def release(self, job: str) -> None:
        self.placer.release(job)
        self._history = self.memo.history(self._history, ("release", job))

    def make_room(self, job: str, newcomer: JobProfile, now: float) -> tuple[Placement, Placement] | None:
        """Asked of the placer itself (it places and releases inside): the history records it,
        so later answers are keyed by the state it left."""
        found = self.placer.make_room(job, newcomer, now)
        self._history = self.memo.history(self._history, ("make_room", job, newcomer, now))
        return found

    def spread_out(self, job: str, now: float) -> Placement | None:
        """Asked of the placer itself, as `make_room`, when it would try (`may_spread_out`): the
        history grows by a try, not by every step boundary, so modes whose steps end at other
        times still share the answers of their admissions."""
        if not self.placer.may_spread_out(job):
            return None
        found = self.placer.spread_out(job, now)
        self._history = self.memo.history(self._history, ("spread_out", job, now))
        return found

    def placements(self) -> dict[str, Placement]:
        return self.placer.placements()

    def __getattr__(self, name: str):  # anything else (view, horizon, ...) is the placer's
        if name == "placer":  # not set yet (a copy being built): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.placer, name)
