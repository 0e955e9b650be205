"""Placement: which node group a job's models live on, and with what phase shift (DESIGN §6).

`Placer.place(profile, now)` returns `Placement(group, phase_shift_s, score, devices,
inflation)` or `Wait(reason)`, and commits a placement it returns; `release(job)` gives the
room back. `decide` is the same decision without committing. Decisions are deterministic:
the same placer state, profile and time give the same answer.

How a decision is made:
1. memory: only groups where every model fits a device arena and the job's host buffers fit
   its nodes are considered (`ResourceView`, searched pod by pod);
2. contention: for each such group g and each candidate phase shift phi (multiples of the
   horizon slot inside one period, at most `max_shifts` of them),
       score(g, phi) = sum over slots of max(0, load_g + shift(demand, phi) - capacity_g) * slot_s,
   the device-time of projected overload. Only slots where load_g + max(demand) exceeds the
   capacity can overload, so only those are evaluated, for all shifts at once (a gather from
   one projection of the job, shifted by index);
3. choice: lowest score; ties go to the group already carrying more load (packing keeps empty
   groups for large jobs), then to the earlier group, then to the smaller shift;
4. slack: the chosen placement's step inflation is estimated for the job and for every job
   already on the group; the job waits when it would exceed its own slack or push a
   co-tenant beyond theirs (only the best candidate is checked: no second-best search).

Inflation model (ours): fluid processor sharing. In a slot where the group's demand L + d
exceeds its capacity c, every busy device-demand progresses at c / (L + d), so the job's work
in that slot takes (L + d) / c times as long: it stretches by overload / c. The job's step
inflation is the mean stretch over its busy time, weighted by its demand:
    inflation = sum_i d_i * overload_i / c  /  sum_i d_i.
First order: it ignores that a stretched phase moves the job's later phases.

`FirstFit` is the baseline: the first memory-feasible group, no phase shift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from plexrl.policy.horizon import Horizon
from plexrl.policy.profile import JobProfile
from plexrl.policy.resources import ResourceView

_TINY = 1e-9  # devices; overload below this is float residue, not contention
_CHUNK_CELLS = 1 << 21  # bounds the (shifts x hot slots) scratch array to ~16 MB
_BLOCK_GROUPS = 8  # hot groups scored per step of the pruned search
_TIGHTEST = 8  # slots per group checked by the cheap can-it-reach-zero filter


@dataclass(frozen=True)
class Placement:
    """Where a job lives. The runtime starts the job's first step `phase_shift_s` after the
    decision time (a start offset; a re-placed job delays its next step by it) and keeps its
    states on `devices` (one per job device, all in `group`) and their nodes."""

    group: str
    phase_shift_s: float
    score: float  # device-seconds of projected overload on the group over the horizon
    devices: tuple[int, ...] = ()
    inflation: float = 0.0  # estimated step inflation of the job, a fraction


@dataclass(frozen=True)
class Wait:
    """The job cannot be placed now; `reason` names the resource that is short."""

    reason: str


@dataclass(frozen=True)
class _Placed:
    profile: JobProfile
    placement: Placement
    anchor_s: float


class Placer:
    """Cluster-wide placement state: the view (memory committed), the horizon (projected load)
    and the jobs placed. `max_shifts` bounds the candidate phase shifts per decision; a period
    longer than that many slots is searched with a coarser stride."""

    def __init__(self, view: ResourceView, horizon_slots: int = 1024, slot_s: float = 1.0, max_shifts: int = 64):
        if max_shifts < 1:
            raise ValueError(f"max_shifts must be >= 1, got {max_shifts}")
        self.view = view
        self.horizon = Horizon(len(view.groups), horizon_slots, slot_s)
        self.max_shifts = max_shifts
        self._placed: dict[str, _Placed] = {}

    # -- the API -------------------------------------------------------------------------------

    def place(self, profile: JobProfile, now: float) -> Placement | Wait:
        decision = self.decide(profile, now)
        if isinstance(decision, Placement):
            self.commit(profile, decision, now)
        return decision

    def decide(self, profile: JobProfile, now: float) -> Placement | Wait:
        if profile.job in self._placed:
            raise ValueError(f"job {profile.job!r} is already placed; release or re-place it")
        self.horizon.advance(now)
        groups = self.view.feasible_groups(profile)
        if len(groups) == 0:
            return Wait(self.view.shortfall(profile))
        shifts = self._shift_slots(profile)
        # Jobs start on slot boundaries, so projections line up with the horizon's slots and
        # complementary jobs can be exactly disjoint; the wait for the boundary is part of the shift.
        aligned = math.ceil(now / self.horizon.slot_s - 1e-9) * self.horizon.slot_s
        demand = self._shifted_demand(profile, aligned, shifts)
        carried = self._carried(groups)
        scores = self._scores(groups, demand, carried)
        g, k = self._pick(scores, carried)
        return self._judge(profile, int(groups[g]), int(shifts[k]), float(scores[g, k]), demand[k], aligned - now)

    def commit(self, profile: JobProfile, placement: Placement, now: float) -> None:
        if len(placement.devices) != profile.devices:
            raise ValueError(
                f"placement of job {profile.job!r} names {len(placement.devices)} devices, "
                f"the job needs {profile.devices}"
            )
        self.horizon.advance(now)
        self._hold(_Placed(profile, placement, now + placement.phase_shift_s))

    def release(self, job: str) -> None:
        placed = self._placed.pop(job, None)
        if placed is not None:
            self.view.free(job)
            self.horizon.remove(job)

    def replace(self, profile: JobProfile, now: float) -> Placement | Wait:
        """Re-place a placed job with a new (measured) profile; on Wait it keeps its old place.
        A new group in the answer means a migration (spill, then restore on the new group)."""
        if profile.job not in self._placed:
            raise ValueError(f"job {profile.job!r} is not placed; use place()")
        old = self._placed[profile.job]
        self.release(profile.job)
        decision = self.place(profile, now)
        if isinstance(decision, Wait):
            self._hold(old)
        return decision

    def profile_of(self, job: str) -> JobProfile:
        """The profile `job` was placed with (what `drifted` compares a measured one against)."""
        return self._placed[job].profile

    def placements(self) -> dict[str, Placement]:
        return {job: p.placement for job, p in self._placed.items()}

    def overload_s(self) -> float:
        """Projected overload of the whole cluster over the horizon, in device-seconds."""
        return float(self.horizon.overload_s(self.view.capacity).sum())

    # -- the steps of a decision ---------------------------------------------------------------

    def _shift_slots(self, profile: JobProfile) -> np.ndarray:
        distinct = max(1, int(np.ceil(profile.period_s / self.horizon.slot_s - 1e-9)))
        stride = -(-distinct // self.max_shifts)
        return np.arange(0, distinct, stride)

    def _shifted_demand(self, profile: JobProfile, now: float, shifts: np.ndarray) -> np.ndarray:
        """demand[k, c]: the job started at now + shifts[k] slots, in ring column c.

        One projection over [origin - max shift, origin + H) serves every shift: shifting by k
        slots is reading it k slots earlier.
        """
        h, top = self.horizon, int(shifts[-1])
        extended = h.project(profile, now, h.origin - top, h.slots + top)
        by_time = sliding_window_view(extended, h.slots)[top - shifts]
        return by_time[:, h.positions()]

    def _scores(self, groups: np.ndarray, demand: np.ndarray, carried: np.ndarray) -> np.ndarray:
        """score[g, k]: overload device-seconds of `groups[g]` with the job shifted by shifts[k].

        Exact pruning: a group with no hot slot (one where load + the job's peak demand exceeds
        capacity) scores 0 at every shift. Once some group is known to score 0, the only
        groups that can still win are those carrying at least as much load that can also
        reach 0; the others are left at +inf unscored. Hot groups are visited from the most
        loaded down.
        """
        hot = self._hot(groups, demand)
        cool = ~hot.any(axis=1)
        scores = np.full((len(groups), len(demand)), np.inf)
        scores[cool] = 0.0
        floor = carried[cool].max() if cool.any() else -np.inf
        hot_rows = np.flatnonzero(~cool)
        hot_rows = hot_rows[np.lexsort((hot_rows, -carried[hot_rows]))]
        may_zero = self._may_reach_zero(groups[hot_rows], demand, hot[hot_rows])
        for lo in range(0, len(hot_rows), _BLOCK_GROUPS):
            block = hot_rows[lo: lo + _BLOCK_GROUPS]
            if carried[block[0]] < floor:
                break
            if floor > -np.inf:
                block = block[may_zero[lo: lo + _BLOCK_GROUPS] & (carried[block] >= floor)]
            scores[block] = self._overload(groups[block], demand, hot[block])
            zero = block[scores[block].min(axis=1) == 0]
            if len(zero):
                floor = max(floor, carried[zero].max())
        return scores

    def _may_reach_zero(self, groups: np.ndarray, demand: np.ndarray, hot: np.ndarray) -> np.ndarray:
        """A necessary condition for a zero score, per group: some shift keeps the job within
        the room left in each of the group's tightest slots. False means the group cannot
        score 0 (a cell overloaded by more than a micro device-second would show in the
        rounded score)."""
        room = np.where(hot, self.view.capacity[groups][:, None] - self.horizon.load[groups], np.inf)
        m = min(_TIGHTEST, room.shape[1])
        tight = np.argpartition(room, m - 1, axis=1)[:, :m]
        allowed = np.take_along_axis(room, tight, axis=1) + 1e-6 / self.horizon.slot_s
        return (demand[:, tight] <= allowed[None]).all(axis=2).any(axis=0)

    def _hot(self, groups: np.ndarray, demand: np.ndarray) -> np.ndarray:
        peak = demand.max()
        return self.horizon.load[groups] + peak > self.view.capacity[groups][:, None] + _TINY

    def _overload(self, groups: np.ndarray, demand: np.ndarray, hot: np.ndarray) -> np.ndarray:
        """Scores of a few groups for all shifts at once, from their hot slots only (the others
        cannot overload at any shift)."""
        scores = np.zeros((len(groups), len(demand)))
        rows, cols = np.nonzero(hot)
        if len(rows) == 0:
            return scores
        base = self.horizon.load[groups[rows], cols] - self.view.capacity[groups[rows]]
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        per_chunk = max(1, _CHUNK_CELLS // len(rows))
        for lo in range(0, len(demand), per_chunk):
            over = np.take(demand[lo: lo + per_chunk], cols, axis=1)
            over += base
            np.maximum(over, 0.0, out=over)
            scores[rows[starts], lo: lo + len(over)] = np.add.reduceat(over, starts, axis=1).T
        # rounding to a micro device-second turns float residue into exact zeros and ties
        return np.round(scores * self.horizon.slot_s, 6)

    def _carried(self, groups: np.ndarray) -> np.ndarray:
        """Projected demand already on each group (rounded so float residue cannot break ties)."""
        return np.round(self.horizon.load[groups].sum(axis=1), 6)

    def _pick(self, scores: np.ndarray, carried: np.ndarray) -> tuple[int, int]:
        """(row, shift index) of the best candidate: lowest score, then most carried load, then
        the earlier group, then the smaller shift (see the module docstring)."""
        rows, shifts = np.nonzero(scores == scores.min())
        best = np.lexsort((shifts, rows, -carried[rows]))[0]
        return int(rows[best]), int(shifts[best])

    def _judge(self, profile: JobProfile, group: int, shift: int, score: float, demand: np.ndarray,
               align_s: float = 0.0) -> Placement | Wait:
        h = self.horizon
        inflation = step_inflation(h.load[group], demand, self.view.capacity[group])
        name = self.view.groups[group].name
        if inflation > profile.slack:
            return Wait(
                f"job {profile.job!r} would be slowed by {inflation:.0%}, beyond its slack of "
                f"{profile.slack:.0%}: even the best placement (group {name!r}, phase shift "
                f"{shift * h.slot_s:g} s) projects {score:.1f} device-s of overload over the horizon"
            )
        hurt = self._hurt_tenant(group, demand)
        if hurt is not None:
            tenant, slowed, slack = hurt
            return Wait(
                f"job {profile.job!r} would slow job {tenant!r} by {slowed:.0%}, beyond its slack of "
                f"{slack:.0%}: even the best placement (group {name!r}, phase shift "
                f"{shift * h.slot_s:g} s) projects {score:.1f} device-s of overload over the horizon"
            )
        devices = self.view.choose_devices(group, profile)
        return Placement(name, shift * h.slot_s + align_s, score, devices, inflation)

    def _hurt_tenant(self, group: int, demand: np.ndarray) -> tuple[str, float, float] | None:
        """The first job already on `group` that the newcomer's `demand` (ring order) would push
        beyond its slack, with its inflation and slack; a job already beyond it before only
        counts if the newcomer makes it worse."""
        h, cap = self.horizon, self.view.capacity[group]
        in_time = h.columns(h.origin, h.slots)
        before, after = h.load[group][in_time], (h.load[group] + demand)[in_time]
        for job, profile, anchor in h.jobs_on(group):
            mine = h.project(profile, anchor, h.origin, h.slots)
            slowed = step_inflation(after - mine, mine, cap)
            if slowed > max(profile.slack, step_inflation(before - mine, mine, cap)) + _TINY:
                return job, slowed, profile.slack
        return None

    def _hold(self, placed: _Placed) -> None:
        job, p = placed.profile.job, placed.placement
        self.view.allocate(job, p.devices, placed.profile.host_bytes_per_device)
        self.horizon.add(job, self.view.index[p.group], placed.profile, placed.anchor_s)
        self._placed[job] = placed


def step_inflation(load: np.ndarray, demand: np.ndarray, capacity: float) -> float:
    """Estimated step inflation of a job with `demand` joining `load`, slot by slot (fluid
    sharing, see the module docstring)."""
    busy = demand.sum()
    if busy <= 0:
        return 0.0
    overload = np.maximum(load + demand - capacity, 0.0)
    return float((demand * overload).sum() / capacity / busy)


class FirstFit(Placer):
    """Baseline: the first group (in topology order) where the memory fits, phase shift 0."""

    def _shift_slots(self, profile: JobProfile) -> np.ndarray:
        return np.zeros(1, dtype=np.int64)

    def _scores(self, groups: np.ndarray, demand: np.ndarray, carried: np.ndarray) -> np.ndarray:
        scores = np.full((len(groups), len(demand)), np.inf)
        scores[:1] = self._overload(groups[:1], demand, self._hot(groups[:1], demand))
        return scores

    def _pick(self, scores: np.ndarray, carried: np.ndarray) -> tuple[int, int]:
        return 0, 0
