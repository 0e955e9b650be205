"""The placer: admits a job onto devices of a node group with a phase shift, composing the
device search (`search.py`), the refusal bound (`refusal.py`), the judgement (`judgement.py`)
over the placed jobs (`tenancy.py`), and the moves of placed jobs (`moves.py`).

How a decision is made (`decide`):
1. memory: groups where the job fits (`ResourceView.feasible_groups`); none: Wait;
2. the refusal bound: when no devices the search could choose would pass the judgement, the
   job waits without a search (most retries of a saturated cluster's queue end there);
3. the search's best candidate (group, phase shift, devices); with `pack_first`, first the
   groups already carrying load (see "Packing first");
4. the judgement of that candidate: a Placement, or a Wait that says whom it would slow.

Packing first (an option, `Placer(pack_first=True)`; WEAVE's order: pack into an existing
group when every member stays within its SLO, else open a new one). By default a job that fits
on devices nobody uses goes there (spread while there is room) and shares only when the search
finds no better. Packing first takes the first group already carrying load (most first) whose
placement the judgement accepts, and searches as before only when none does: the tenants pay
up to their slack (or the pack limit) now so that devices stay free for a later job, which
helps when one comes and costs a little speed when none does. `plexrl sim WORKLOAD` runs it as
`plexrl-pack`; the default stays spread.

`FirstFit` is the baseline: the first group that takes the job, no phase shift, devices with
the fewest jobs.

Invariant: decisions are deterministic: the same placer state, profile and time give the same
answer (`sim/placement_memo.py` replays answers on it).
"""

from __future__ import annotations

import math

import numpy as np

from plexrl.policy.horizon import Horizon
from plexrl.policy.placement.cotenancy import TINY
from plexrl.policy.placement.decisions import Placement, Wait
from plexrl.policy.placement.judgement import Judgement
from plexrl.policy.placement.moves import Moves
from plexrl.policy.placement.refusal import RefusalBound
from plexrl.policy.placement.search import Candidate, DeviceSearch
from plexrl.policy.placement.tenancy import Placed, Tenancy
from plexrl.policy.profile import JobProfile
from plexrl.policy.resources import ResourceView


class Placer:
    """Cluster-wide placement state: the view (memory committed), the horizon (projected load
    per device) and the jobs placed. `max_shifts` bounds the candidate phase shifts per
    decision. `by_effect` (default): a placement that shares devices is taken only when it
    lowers the summed completion time of the jobs involved (`judgement.py`, "Packing by
    effect"). `pack_limit` (an option, off by default): the largest slack a placement judges a
    job by when it and every job it would share devices with end; None judges each job by its
    own slack. `pooled`: a group's devices run any of its jobs' calls
    (`cotenancy.pooled_inflation`). `pack_first`: a group already carrying jobs takes the
    newcomer when the judgement lets it, before an empty one does (see "Packing first")."""

    def __init__(self, view: ResourceView, horizon_slots: int = 1024, slot_s: float = 1.0, max_shifts: int = 64,
                 pack_limit: float | None = None, pooled: bool = False, pack_first: bool = False,
                 by_effect: bool = True):
        if max_shifts < 1:
            raise ValueError(f"max_shifts must be >= 1, got {max_shifts}")
        if pack_limit is not None and not pack_limit >= 0:
            raise ValueError(f"pack_limit must be >= 0 (a fraction of a step) or None, got {pack_limit}")
        self.pack_limit, self.pack_first, self.pooled, self.max_shifts = pack_limit, pack_first, pooled, max_shifts
        self.by_effect = by_effect
        self.view = view
        self.horizon = Horizon(len(view.row_device), horizon_slots, slot_s)
        self.tenancy = Tenancy(view, self.horizon)
        self.judgement = Judgement(self.tenancy, pack_limit, pooled, by_effect)
        self.refusal = RefusalBound(self.judgement)
        self.search = DeviceSearch(self.tenancy, max_shifts)
        self.moves = Moves(self)

    # -- decisions -----------------------------------------------------------------------------

    def place(self, profile: JobProfile, now: float) -> Placement | Wait:
        """`decide`, and commit the placement it returns."""
        decision = self.decide(profile, now)
        if isinstance(decision, Placement):
            self.commit(profile, decision, now)
        return decision

    def decide(self, profile: JobProfile, now: float) -> Placement | Wait:
        """Where `profile`'s job would be placed now, without committing it."""
        decision = self._decide(profile, now)
        if isinstance(decision, Wait) and self.judgement.limit(profile, self.tenancy.open_ended == 0) < profile.slack:
            return Wait(f"{decision.reason} (its slack is {profile.slack:.0%}, but sharing devices with jobs that "
                        f"end pays only while it slows each by less than {self.pack_limit:.0%})")
        return decision

    def _decide(self, profile: JobProfile, now: float) -> Placement | Wait:
        if profile.job in self.tenancy.placed:
            raise ValueError(f"job {profile.job!r} is already placed; release or re-place it")
        self.horizon.advance(now)
        groups = self.view.feasible_groups(profile)
        if len(groups) == 0:
            return Wait(self.view.shortfall(profile))
        self.judgement.now = now
        refused = self.refusal.refused_everywhere(profile, groups)
        if refused is not None:
            return refused
        shifts = self._shift_slots(profile)
        # Jobs start on slot boundaries, so projections line up with the horizon's slots and
        # complementary jobs can be exactly disjoint; the wait for the boundary is part of the shift.
        aligned = math.ceil(now / self.horizon.slot_s - 1e-9) * self.horizon.slot_s
        share = self.search.shifted_share(profile, aligned, shifts)
        if self.pack_first:
            packed = self._packed(groups, profile, shifts, share, aligned - now)
            if packed is not None:
                return packed
        best = self._search(groups, profile, share)
        return self.judgement.judge(profile, best, int(shifts[best.shift]), share[best.shift], aligned - now)

    def _shift_slots(self, profile: JobProfile) -> np.ndarray:
        return self.search.shift_slots(profile)

    def _search(self, groups: np.ndarray, profile: JobProfile, share: np.ndarray) -> Candidate:
        return self.search.best(groups, profile, share, self.view.units_per_node(profile))

    def _packed(self, groups: np.ndarray, profile: JobProfile, shifts: np.ndarray, share: np.ndarray,
                align_s: float) -> Placement | None:
        """`pack_first`: the placement in the first group already carrying load, in the
        search's tie order (most carried first), whose best devices and shift (the search on
        that group alone) the judgement accepts; None when no such group takes the job."""
        order, carried = self.search.tie_order(groups, self.search.row_sums_and_maxima()[0])
        units = self.view.units_per_node(profile)
        for g in order[carried > 0.0]:
            best = self.search.best(np.array([g]), profile, share, units)
            decision = self.judgement.judge(profile, best, int(shifts[best.shift]), share[best.shift], align_s)
            if isinstance(decision, Placement):
                return decision
        return None

    # -- what is placed ------------------------------------------------------------------------

    def commit(self, profile: JobProfile, placement: Placement, now: float) -> None:
        if len(placement.devices) != profile.devices:
            raise ValueError(
                f"placement of job {profile.job!r} names {len(placement.devices)} devices, "
                f"the job needs {profile.devices}"
            )
        self.horizon.advance(now)
        self.tenancy.hold(Placed(profile, placement, now + placement.phase_shift_s))
        self.judgement.started.setdefault(profile.job, now + placement.phase_shift_s)

    def observe(self, job: str, inflation: float) -> None:
        """A placed job's measured step inflation (its recent steps against its profile's
        period); admission judges the job by it from now on (`judgement.py`)."""
        if job in self.tenancy.placed:
            self.tenancy.measured[job] = float(inflation)

    def release(self, job: str) -> None:
        """`job` is done (or was never started): its place and its record go."""
        self.vacate(job)
        self.judgement.started.pop(job, None)

    def vacate(self, job: str) -> None:
        """`job` leaves its place to be placed again (a move, a re-placement): when its run began
        stays (`Judgement.started`: what is left of its run is judged from it)."""
        self.moves.forget(job)
        self.tenancy.release(job)

    def replace(self, profile: JobProfile, now: float) -> Placement | Wait:
        """Re-place a placed job with a new (measured) profile; on Wait it keeps its old place.
        A new group in the answer means a migration (spill, then restore on the new group)."""
        if profile.job not in self.tenancy.placed:
            raise ValueError(f"job {profile.job!r} is not placed; use place()")
        old, measured = self.tenancy.placed[profile.job], self.tenancy.measured.get(profile.job)
        self.vacate(profile.job)
        decision = self.place(profile, now)
        if isinstance(decision, Wait):
            self.tenancy.hold(old)
            if measured is not None:  # it stays where it was measured: admission still judges it by that
                self.tenancy.measured[profile.job] = measured
        return decision

    def reprofile(self, profile: JobProfile) -> None:
        """A placed job's profile is now `profile` (measured), where it is: the same devices and
        phase. What the placer projects and judges from now on rests on it; a re-placement it
        was refused leaves the job running there, and its guess would mislead every decision
        after. Its device count must be the placement's."""
        old, measured = self.tenancy.placed[profile.job], self.tenancy.measured.get(profile.job)
        if profile.devices != len(old.placement.devices):
            raise ValueError(f"job {profile.job!r} is placed on {len(old.placement.devices)} devices; a profile "
                             f"of {profile.devices} needs a re-placement")
        self.vacate(profile.job)
        self.tenancy.hold(Placed(profile, old.placement, old.anchor_s))
        if measured is not None:  # measured where it still is: a new profile does not undo that
            self.tenancy.measured[profile.job] = measured

    # -- moves of placed jobs (`moves.py`) -----------------------------------------------------

    def room_if_moved(self, job: str) -> int:
        return self.moves.room_if_moved(job)

    def make_room(self, job: str, newcomer: JobProfile, now: float) -> tuple[Placement, Placement] | None:
        return self.moves.make_room(job, newcomer, now)

    def spread_out(self, job: str, now: float) -> Placement | None:
        return self.moves.spread_out(job, now)

    def may_spread_out(self, job: str) -> bool:
        return self.moves.may_spread_out(job)

    # -- questions -----------------------------------------------------------------------------

    def profile_of(self, job: str) -> JobProfile:
        """The profile `job` was placed with (what `drifted` compares a measured one against)."""
        return self.tenancy.placed[job].profile

    def placements(self) -> dict[str, Placement]:
        return {job: p.placement for job, p in self.tenancy.placed.items()}

    def inflation_of(self, job: str) -> float:
        """The step inflation the model predicts now for placed `job` with the co-tenants it
        has (`cotenancy.py`); 0.0 for a job alone on its devices."""
        return self.judgement.inflation_of(job)

    def overload_s(self) -> float:
        """Projected overload of the whole cluster over the horizon, in device-seconds."""
        return float(self.horizon.overload_s(np.ones(len(self.horizon.load))).sum())


class FirstFit(Placer):
    """Baseline: the first group (in topology order) that takes the job, phase shift 0, the
    devices with the fewest jobs (`ResourceView.choose_devices`). A group takes it when its
    memory fits and the placement keeps every job within what it is judged by (`Judgement`);
    when none does, the job waits for the reason the first memory-feasible group gives. (A
    group refused by the slack check is passed over, as first fit passes over a full bin: a
    job does not wait for a shared group while a later one is free.)"""

    def _shift_slots(self, profile: JobProfile) -> np.ndarray:
        return np.zeros(1, dtype=np.int64)

    def _search(self, groups: np.ndarray, profile: JobProfile, share: np.ndarray) -> Candidate:
        first = None
        for g in groups:
            candidate = self._candidate(int(g), profile, share)
            if isinstance(self.judgement.judge(profile, candidate, 0, share[0]), Placement):
                return candidate
            first = first or candidate
        return first

    def _candidate(self, g: int, profile: JobProfile, share: np.ndarray) -> Candidate:
        rows = tuple(self.view.device_rows[d] for d in self.view.choose_devices(g, profile))
        lo = min(rows)
        hot = self.horizon.load[lo: max(rows) + 1] + share.max() > 1.0 + TINY
        costs = self.search.device_costs(lo, share, hot)
        return Candidate(g, 0, float(np.round(costs[[r - lo for r in rows], 0].sum(), 6)), rows)
