"""Moving placed jobs (ours), at their step boundaries (nothing of theirs in flight).

- Making room, `make_room(job, newcomer, now)`, while jobs wait: the job moves when that lets a
  waiting job start on what it leaves. It must be alone on its devices and its group must then
  have the newcomer's devices free (`room_if_moved`); it goes wherever `place` puts it, onto
  devices nobody uses or into a share every tenant's judgement accepts (the same judgement as a
  newcomer's: sharing devices within every tenant's slack beats leaving a job in the queue).
  The try is exact: release the job, place the newcomer, place the job; both commit, or
  everything is put back. It mends fragments too: departures leave free devices scattered
  over node groups, none with enough for a waiting job that needs several nodes in one group.
- Spreading out, `spread_out(job, now)`, while no job waits: a job that shares a device moves
  onto devices nobody uses when `place` puts it there (else nothing changes), so sharing lasts
  as long as it lets jobs start and shared jobs run alone, at full speed, when there is room.
What a move costs the moved job (its host state crossing to its new nodes, its states loaded
anew, and a phase shift that aligns it with its new co-tenants) is the caller's: the simulator
pauses the job for it (`sim/plexrl_mode.py`), the runtime migrates it (`runtime/job_placer.py`).
`plexrl sim W --modes colocated,plexrl,plexrl-nomove` compares with and without moves.

Invariants (tests/test_placement.py): a move that is not taken changes nothing (the next
decisions are those of a placer never asked; `Tenancy.mark`, `rewind`). Placing adds load, so
only a release can turn a refusal around: what was refused is remembered with the count of
releases (`Tenancy.releases`) and not tried again until that count moves on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from plexrl.policy.placement.decisions import Placement
from plexrl.policy.placement.tenancy import Mark, Placed
from plexrl.policy.profile import JobProfile

if TYPE_CHECKING:
    from plexrl.policy.placement.placer import Placer


@dataclass(frozen=True)
class _Undo:
    """What a tentative move's release changed (`Moves._take_out`), to put back."""

    placed: Placed
    measured: float | None  # the job's measured inflation
    mark: Mark


class Moves:
    """The moves of `placer`'s placed jobs, and what it refused since the last release."""

    def __init__(self, placer: Placer):
        self.placer, self.tenancy = placer, placer.tenancy
        # (`releases`, the (job, newcomer) pairs `make_room` failed at since): forgotten at the next release
        self.room_refused: tuple[int, set[tuple[str, str]]] = (-1, set())
        # job -> `releases` when it last found no other place (`make_room`) / no unused devices
        # (`spread_out`): not tried again before a job is released
        self.no_other_place: dict[str, int] = {}
        self.no_unused: dict[str, int] = {}

    def forget(self, job: str) -> None:
        """`job` is released: what it was refused no longer holds."""
        self.no_other_place.pop(job, None)
        self.no_unused.pop(job, None)

    def room_if_moved(self, job: str) -> int:
        """The devices `job`'s group would have unused if the placed job moved away at its step
        boundary: 0 when it may not move to make room (it shares a device, or it found no other
        place since the last release; see `make_room`)."""
        t = self.tenancy
        rows = t.job_rows.get(job)
        if rows is None or t.shares_a_device(job) or self.no_other_place.get(job) == t.releases:
            return 0
        return int(t.unused()[t.row_group[rows[0]]]) + len(rows)

    def make_room(self, job: str, newcomer: JobProfile, now: float) -> tuple[Placement, Placement] | None:
        """Making room: whether moving placed `job` (at its step boundary) lets waiting
        `newcomer` start. Tried, when `room_if_moved` leaves the newcomer devices enough, as:
        release the job, place the newcomer, place the job again, where `place` puts any job
        (devices nobody uses first, else a share every tenant's judgement accepts); both commit
        when both are placed, (the job's new placement, the newcomer's), and nothing changes
        otherwise. A pair that failed is not tried again until a job is released, nor is a job
        that found no other place (beside one newcomer: another would most often take the same
        devices), nor one the refusal bound turns away before any try, its devices taken
        (`RefusalBound.no_place_beside_itself`). The job's measured inflation was measured where
        it was: it is dropped when the job moves."""
        placer, t = self.placer, self.tenancy
        if newcomer.job in t.placed or self.room_if_moved(job) < newcomer.devices:
            return None
        key = (job, newcomer.job)
        if self.room_refused[0] == t.releases and key in self.room_refused[1]:
            return None
        if placer.refusal.no_place_beside_itself(t.placed[job].profile):
            self.no_other_place[job] = t.releases
            return None
        undo = self._take_out(job)
        first = placer.place(newcomer, now)
        if isinstance(first, Placement):
            moved = placer.place(undo.placed.profile, now)
            if isinstance(moved, Placement):
                if moved.devices == undo.placed.placement.devices and undo.measured is not None:
                    t.measured[job] = undo.measured  # it stays where it was measured
                return moved, first
            placer.release(newcomer.job)
        self._put_back(undo)
        if isinstance(first, Placement):
            self.no_other_place[job] = t.releases
        else:
            if self.room_refused[0] != t.releases:
                self.room_refused = (t.releases, set())
            self.room_refused[1].add(key)
        return None

    def spread_out(self, job: str, now: float) -> Placement | None:
        """Spreading when there is room: placed `job`, which shares a device, moves (at its step
        boundary) onto devices nobody uses when the placer puts it there; its new placement, or
        None with nothing changed. Asked while no job waits, so that sharing lasts only as long
        as it lets a job start (`make_room`, admission). A job that found no such place is not
        tried again until a job is released. Its measured inflation is dropped when it moves."""
        if not self.may_spread_out(job):
            return None
        undo = self._take_out(job)
        moved = self.placer.place(undo.placed.profile, now)
        if isinstance(moved, Placement):
            if not self.tenancy.shares_a_device(job):
                return moved
            self.placer.vacate(job)
        self._put_back(undo)
        self.no_unused[job] = self.tenancy.releases
        return None

    def may_spread_out(self, job: str) -> bool:
        """Whether `spread_out` would try: the placed job shares a device, some group has as many
        devices unused as it holds, and it was not refused since the last release. Nothing is
        changed by asking (most step boundaries end here)."""
        t = self.tenancy
        rows = t.job_rows.get(job)
        if rows is None or not t.shares_a_device(job) or self.no_unused.get(job) == t.releases:
            return False
        return t.unused().max(initial=0) >= len(rows)

    def _take_out(self, job: str) -> _Undo:
        """A tentative move begins: placed `job` is released; returns what `_put_back` needs."""
        t = self.tenancy
        undo = _Undo(t.placed[job], t.measured.get(job), t.mark())
        self.placer.vacate(job)
        return undo

    def _put_back(self, undo: _Undo) -> None:
        """A tentative move failed: the job is held where it was, as if it had never left (and
        every cache of that state holds again, whatever the tentative states computed)."""
        self.tenancy.hold(undo.placed)
        if undo.measured is not None:
            self.tenancy.measured[undo.placed.profile.job] = undo.measured
        self.tenancy.rewind(undo.mark)

