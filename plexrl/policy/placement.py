"""Placement: which devices of which node group a job's models live on, and with what phase
shift (docs/design.md §6).

`Placer.place(profile, now)` returns `Placement(group, phase_shift_s, score, devices,
inflation)` or `Wait(reason)`, and commits a placement it returns; `release(job)` gives the
room back. `decide` is the same decision without committing. Decisions are deterministic:
the same placer state, profile and time give the same answer.

Load is projected per device, not per group: a job runs on its own devices only, so two jobs
whose busy phases collide slow each other down exactly when they share devices, however idle
the rest of their group is. A job on n devices puts 1/n of its demand on each (the horizon's
rows are devices, capacity 1.0 each).

How a decision is made:
1. memory: only groups where every model fits a device arena and the job's host buffers fit
   its nodes are considered (`ResourceView`, one vector pass over the nodes);
2. contention: for each such group, each of its devices d and each candidate phase shift phi
   (multiples of the horizon slot inside one period, at most `max_shifts` of them),
       cost(d, phi) = sum over slots of max(0, load_d + shift(demand, phi) / n - 1) * slot_s,
   the device-time of projected overload if the job used d. Only slots where load_d plus the
   job's peak share exceeds 1 can overload, so only those are evaluated, for all shifts at
   once (a gather from one projection of the job, shifted by index);
3. devices: the group's score at phi is the least total cost of n devices, taken in whole
   replicas per node (`replica_devices`) within each node's host room: per node the cheapest
   devices first, then the cheapest replicas over the group's nodes (the greedy choice is
   optimal: per node, cost grows with every replica added). Equal costs go to the device
   carrying less projected load (spreading within a group), then the lower device;
4. choice: lowest score; ties go to the group already carrying more load (packing keeps empty
   groups for large jobs), then to the earlier group, then to the smaller shift. Groups are
   visited in that tie order, so the first that scores 0 ends the search (exact);
5. slack: the choice's step inflation is estimated for the job and for every job sharing a
   device with it; the job waits when it would exceed its own slack or push a co-tenant
   beyond theirs; a job whose run ends (`JobProfile.ends`) is judged by at most `pack_limit`
   among tenants that end too ("Packing when it pays", below). Only the best candidate is
   checked: no second-best search. When no devices the search could choose would pass this
   check (`_refused_everywhere`, an exact bound under the call model), the job waits without a
   search: most retries of a saturated cluster's queue end there.

Inflation model (ours), when every profile involved knows its calls (`JobProfile.barriers`,
`residual_s`): non-preemptive sharing. A device runs one call at a time, to its end. Each of
a job's phases (a barrier: its calls must all end before the step moves on) that starts while
a co-tenant's call holds a shared device waits for that call's rest. With the jobs' relative
phases taken as uniform (phase alignment drifts once a wait has moved a job's steps), a
co-tenant k busy with calls of lengths r_i over a period P_k is found mid-call with
probability sum r_i / P_k, and the rest of that call averages sum r_i^2 / (2 sum r_i): the
expected wait per arrival on one of its devices is `residual_s` = sum r_i^2 / (2 P_k)
(mean residual life). A barrier ends with its last call, and a co-tenant's phase holds all
its devices at once (its calls start together), so a barrier that shares one device with k
waits for the rest of k's call as long as one that shares them all: a job j sharing any of
its devices with k slows by
    barriers_j * sum_k residual_s_k / period_j                    (`wait_inflation`)
whatever fraction of its devices it shares. The wait falls on whoever arrives second, so a job
of many short phases (agentic turns) loses more than a fluid split says, and a job of few long
calls with long idle (code with sandboxes) less. Two jobs whose busy shares fit the devices take
turns instead where that slows them less (`_pair_inflations`). With three or more jobs on the
devices a phase also waits for the calls queued ahead of it (`_inflations`, the arrival
theorem). Whatever the waits, no set of jobs is predicted to keep its devices busy more than all
the time (`_conserving`: two jobs busy 75% each run 50% slow or more). Out of scope (first
order): a slowed co-tenant's calls come less often, and the request priority lets short calls
overtake long ones.

Elastic rollouts (the simulator's PlexRL jobs while they share, `sim/rollout.py`): a rollout
turn does not wait for a co-tenant's rollout but takes a share of its replicas, so of a
profile's barriers its rollout turns (`JobProfile.rollout_barriers`) wait only for the rest of
the co-tenant's other calls (`residual_s - rollout_residual_s`), and its seconds on all its
replicas (`rollout_s`) are slowed by the time they meet the co-tenant's (two random intervals
of lengths s_j and s_k in k's period overlap s_j * s_k / P_k on average, and in the overlap the
two split the replicas, so its decoding there takes twice as long): `wait_s`. A co-tenant's
call still waits for a rollout's stretch to end (its segment: `residual_s` counts it). A
profile that names no rollouts (a runtime's measured one, `plexrl-pinned`) is judged by the
pinned model above.

Measured inflation feeds back (`observe`): a tenant whose measured inflation is known is
judged by it plus what the newcomer adds, so a group whose tenants run under their
predictions may take more, and one with a tenant past its slack takes nobody onto its devices.
How well the model predicts is what `plexrl bench cotenancy` measures (docs/benchmarks.md).

Pooled devices (ours), `Placer(pooled=True)`: the runtime's group scheduler runs a state on
whichever device of its group is free, so a job's co-tenants are every job of its group, and
`pooled_inflation` replaces `wait_inflation`: a phase waits only while the co-tenants' calls
hold all the group's devices (the chance of that from their demand profiles, independent
phases), for the first of those calls to end. Two jobs that run one call at a time never wait
on two devices; a third waits while both others run. The per-device search still places the
job's copies on devices, for memory.

Packing when it pays (ours). A job's slack is what it tolerates, not what the placer should
fill: sharing devices trades the tenants' speed for the newcomer's start. Take a newcomer of
run length L and a tenant of the same length with R of its run left: waiting for the tenant
costs the newcomer R; sharing at inflation i costs about i * L (newcomer) + i * R (tenant).
Sharing lowers the sum of completion times when i < R / (L + R), and with the tenant found at
a uniform point of its run (E[R] = L / 2) when i < 1/3 = `PACKING_PAYS`, the default
`pack_limit`. The premise is that both finish: a job judges a placement by
min(slack, `pack_limit`) only when it declared its length (`JobProfile.ends`: the simulator's
jobs and a runtime job given its steps) and so did every job it would share devices with. A
newcomer next to an open-ended tenant (a service session may hold its model for days) is
judged by its own slack, as is such a tenant, so nobody waits on a job that never leaves.
Jobs with slack below the limit are unaffected. `pack_limit=None` judges every job by its own
slack; the runtime takes it as `ClusterConfig.pack_limit`, the simulator as the workload's
`pack_limit` or `--pack-limit`.

Fallback inflation model (ours), for profiles without calls: fluid processor sharing per
device. In a slot where a device's demand L + d exceeds 1, every busy share on it progresses at
1 / (L + d), so work there stretches by the overload. A job's step is as slow as its most
contended device (its collectives and the end of its rollout wait for every device), so its
inflation is the largest over its devices of
    sum_i d_i * overload_i  /  sum_i d_i.
First order: it ignores that a stretched phase moves the job's later phases.

Packing first (an option, `Placer(pack_first=True)`; WEAVE's order: pack into an existing
group when every member stays within its SLO, else open a new one). By default a job that fits
on devices nobody uses goes there (spread while there is room) and shares only when the search
finds no better. Packing first takes the first group already carrying load (most first) whose
placement the judgement accepts, and searches as before only when none does: the tenants pay
up to their slack (or the pack limit) now so that devices stay free for a later job, which
helps when one comes and costs a little speed when none does. `plexrl sim WORKLOAD` runs it as
`plexrl-pack`; the default stays spread.

Moving placed jobs (ours), at their step boundaries (nothing of theirs in flight).
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

`FirstFit` is the baseline: the first group that takes the job (memory and slack), no phase
shift, devices with the fewest jobs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from plexrl.policy.horizon import Horizon
from plexrl.policy.profile import JobProfile
from plexrl.policy.resources import ResourceView

_TINY = 1e-9  # devices; overload below this is float residue, not contention
_CHUNK_CELLS = 1 << 21  # bounds the (shifts x hot cells) scratch array to ~16 MB
_PROBES = 48  # hot columns sampled across the horizon for the cheap lower bound of a score
_BOUND_BLOCK = 32  # groups bounded per vector pass
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # spreads probes over every period (`_evenly_and_scattered`)
_HEAD_PROBES = 12  # probes every (shift, row) pair is tested on before the rest (`_fits_on_probes`)
_MAX_RUNS = 16  # runs of occupied rows reduced slice by slice; more are gathered first
PACKING_PAYS = 1.0 / 3.0  # the most sharing may slow a job and still pay, for jobs that end (module docstring)


@dataclass(frozen=True)
class Placement:
    """Where a job lives. The runtime starts the job's first step `phase_shift_s` after the
    decision time (a start offset; a re-placed job delays its next step by it) and keeps its
    states on `devices` (one per job device, all in `group`) and their nodes."""

    group: str
    phase_shift_s: float
    score: float  # device-seconds of projected overload on the job's devices over the horizon
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


@dataclass(frozen=True)
class _Undo:
    """What a tentative move's release changed (`Placer._take_out`), to put back."""
    placed: _Placed
    measured: float | None  # the job's measured inflation
    version: int
    releases: int
    cotenancy: dict  # `Placer._cotenancy`, `_node_tenancy` and `_free` as they were
    node_tenancy: dict
    free: tuple


@dataclass(frozen=True)
class _Candidate:
    group: int
    shift: int  # index into the decision's shifts
    score: float
    rows: tuple[int, ...]  # the job's device rows


class Placer:
    """Cluster-wide placement state: the view (memory committed), the horizon (projected load
    per device) and the jobs placed. `max_shifts` bounds the candidate phase shifts per
    decision; a period longer than that many slots is searched with a coarser stride.
    `pack_limit`: the largest slack a placement judges a job by when it and every job it
    would share devices with end (`JobProfile.ends`; see "Packing when it pays"); None judges
    each job by its own slack. `pack_first`: a group already carrying jobs takes the newcomer
    when the judgement lets it, before an empty one does (see "Packing first")."""

    def __init__(self, view: ResourceView, horizon_slots: int = 1024, slot_s: float = 1.0, max_shifts: int = 64,
                 pack_limit: float | None = PACKING_PAYS, pooled: bool = False, pack_first: bool = False):
        if max_shifts < 1:
            raise ValueError(f"max_shifts must be >= 1, got {max_shifts}")
        if pack_limit is not None and not pack_limit >= 0:
            raise ValueError(f"pack_limit must be >= 0 (a fraction of a step) or None, got {pack_limit}")
        self.pack_limit = pack_limit
        self.pack_first = pack_first
        self.pooled = pooled  # a group's devices run any of its jobs' calls (`pooled_inflation`)
        self.view = view
        self.horizon = Horizon(len(view.row_device), horizon_slots, slot_s)
        self.max_shifts = max_shifts
        self._placed: dict[str, _Placed] = {}
        self._open_ended = 0  # placed jobs whose run has no known end (`JobProfile.ends` False)
        self._units: np.ndarray | None = None  # replicas per node, cached for one search
        self._measured: dict[str, float] = {}  # job -> its latest measured step inflation (`observe`)
        # jobs with a share on each row; a row without any holds exactly 0.0 in every column
        # (the horizon adds to a row only for a job on it and rebuilds a row from zeros on remove)
        self._row_jobs = np.zeros(len(view.row_device), dtype=np.int64)
        self._cotenancy: dict[str, tuple[dict[str, tuple[JobProfile, float]], float]] = {}  # `_cotenants`
        self._inflation_memo: dict = {}  # the call model's answers by set of profiles (`wait_inflation`'s memo)
        self._node_tenancy: dict[int, list[tuple[tuple[str, ...], int]]] = {}  # `_tenancies`, until a change
        self._job_rows: dict[str, np.ndarray] = {}  # placed job -> its device rows
        self._version = 0  # counts the changes of what is placed
        self._releases = 0  # counts the jobs released: only a release gives a job's move more room
        # (`_releases`, the (job, newcomer) pairs `make_room` failed at since): forgotten at the next release
        self._room_refused: tuple[int, set[tuple[str, str]]] = (-1, set())
        # job -> `_releases` when it last found no other place (`make_room`) / no unused devices
        # (`spread_out`): not tried again before a job is released
        self._no_other_place: dict[str, int] = {}
        self._no_unused: dict[str, int] = {}
        # (`_version`, unused devices per group, `room_if_moved` per job), as of the latest change
        self._free: tuple[int, np.ndarray, dict[str, int]] = (-1, np.zeros(0, dtype=np.int64), {})
        self._node_first_row = np.array([a for a, _ in view.node_rows], dtype=np.int64)
        self._group_bounds = np.array(view.group_rows, dtype=np.int64).reshape(-1, 2)  # (first, end) row
        self._row_group = np.repeat(np.arange(len(view.groups)), self._group_bounds[:, 1] - self._group_bounds[:, 0])

    # -- the API -------------------------------------------------------------------------------

    def place(self, profile: JobProfile, now: float) -> Placement | Wait:
        decision = self.decide(profile, now)
        if isinstance(decision, Placement):
            self.commit(profile, decision, now)
        return decision

    def decide(self, profile: JobProfile, now: float) -> Placement | Wait:
        decision = self._decide(profile, now)
        if isinstance(decision, Wait) and self._limit(profile, self._open_ended == 0) < profile.slack:
            return Wait(f"{decision.reason} (its slack is {profile.slack:.0%}, but sharing devices with jobs that "
                        f"end pays only while it slows each by less than {self.pack_limit:.0%})")
        return decision

    def _limit(self, profile: JobProfile, others_end: bool) -> float:
        """The slowdown `profile`'s job is judged by in a placement: its slack, at most
        `pack_limit` when it ends and so do the jobs it would share with (`others_end`)."""
        if self.pack_limit is None or not (profile.ends and others_end) or profile.slack <= self.pack_limit:
            return profile.slack
        return self.pack_limit

    def _decide(self, profile: JobProfile, now: float) -> Placement | Wait:
        if profile.job in self._placed:
            raise ValueError(f"job {profile.job!r} is already placed; release or re-place it")
        self.horizon.advance(now)
        groups = self.view.feasible_groups(profile)
        if len(groups) == 0:
            return Wait(self.view.shortfall(profile))
        refused = self._refused_everywhere(profile, groups)
        if refused is not None:
            return refused
        shifts = self._shift_slots(profile)
        # Jobs start on slot boundaries, so projections line up with the horizon's slots and
        # complementary jobs can be exactly disjoint; the wait for the boundary is part of the shift.
        aligned = math.ceil(now / self.horizon.slot_s - 1e-9) * self.horizon.slot_s
        share = self._shifted_share(profile, aligned, shifts)
        if self.pack_first:
            packed = self._packed(groups, profile, shifts, share, aligned - now)
            if packed is not None:
                return packed
        best = self._search(groups, profile, share)
        return self._judge(profile, best, int(shifts[best.shift]), share[best.shift], aligned - now)

    def _packed(self, groups: np.ndarray, profile: JobProfile, shifts: np.ndarray, share: np.ndarray,
                align_s: float) -> Placement | None:
        """`pack_first`: the placement in the first group already carrying load, in the
        search's tie order (most carried first), whose best devices and shift (`_visit` on that
        group alone) the judgement accepts; None when no such group takes the job."""
        order, carried = self._tie_order(groups, self._row_sums_and_maxima()[0])
        self._units = self.view.units_per_node(profile)
        try:
            for g in order[carried > 0.0]:
                best = self._visit(np.array([g]), profile, share)
                decision = self._judge(profile, best, int(shifts[best.shift]), share[best.shift], align_s)
                if isinstance(decision, Placement):
                    return decision
            return None
        finally:
            self._units = None

    def commit(self, profile: JobProfile, placement: Placement, now: float) -> None:
        if len(placement.devices) != profile.devices:
            raise ValueError(
                f"placement of job {profile.job!r} names {len(placement.devices)} devices, "
                f"the job needs {profile.devices}"
            )
        self.horizon.advance(now)
        self._hold(_Placed(profile, placement, now + placement.phase_shift_s))

    def observe(self, job: str, inflation: float) -> None:
        """A placed job's measured step inflation (its recent steps against its profile's
        period); admission judges the job by it from now on (see the module docstring)."""
        if job in self._placed:
            self._measured[job] = float(inflation)

    def release(self, job: str) -> None:
        self._measured.pop(job, None)
        self._no_other_place.pop(job, None)
        self._no_unused.pop(job, None)
        placed = self._placed.pop(job, None)
        if placed is not None:
            self.view.free(job)
            self.horizon.remove(job)
            self._open_ended -= not placed.profile.ends
            self._row_jobs[self._job_rows.pop(job)] -= 1
            self._cotenancy.clear()
            self._node_tenancy.clear()
            self._version += 1
            self._releases += 1

    def replace(self, profile: JobProfile, now: float) -> Placement | Wait:
        """Re-place a placed job with a new (measured) profile; on Wait it keeps its old place.
        A new group in the answer means a migration (spill, then restore on the new group)."""
        if profile.job not in self._placed:
            raise ValueError(f"job {profile.job!r} is not placed; use place()")
        old, measured = self._placed[profile.job], self._measured.get(profile.job)
        self.release(profile.job)
        decision = self.place(profile, now)
        if isinstance(decision, Wait):
            self._hold(old)
            if measured is not None:  # it stays where it was measured: admission still judges it by that
                self._measured[profile.job] = measured
        return decision

    def room_if_moved(self, job: str) -> int:
        """The devices `job`'s group would have unused if the placed job moved away at its step
        boundary: 0 when it may not move to make room (it shares a device, or it found no other
        place since the last release; see `make_room`)."""
        free, rooms = self._unused()
        room = rooms.get(job)
        if room is None:
            rows = self._job_rows.get(job)
            room = 0
            if (rows is not None and not (self._row_jobs[rows] > 1).any()
                    and self._no_other_place.get(job) != self._releases):
                room = int(free[self._row_group[rows[0]]]) + len(rows)
            rooms[job] = room
        return room

    def make_room(self, job: str, newcomer: JobProfile, now: float) -> tuple[Placement, Placement] | None:
        """Making room: whether moving placed `job` (at its step boundary) lets waiting
        `newcomer` start. Tried, when `room_if_moved` leaves the newcomer devices enough, as:
        release the job, place the newcomer, place the job again, where `place` puts any job
        (devices nobody uses first, else a share every tenant's judgement accepts); both commit
        when both are placed, (the job's new placement, the newcomer's), and nothing changes
        otherwise. Placing adds load, so only a release can turn a refusal around: a pair that
        failed is not tried again until a job is released, nor is a job that found no other
        place (beside one newcomer: another would most often take the same devices), nor one
        the bound of `_refused_everywhere` turns away before any try, its devices taken
        (`_no_place_beside_itself`). The job's measured inflation was measured where it was: it
        is dropped when the job moves."""
        if newcomer.job in self._placed or self.room_if_moved(job) < newcomer.devices:
            return None
        key = (job, newcomer.job)
        if self._room_refused[0] == self._releases and key in self._room_refused[1]:
            return None
        if self._no_place_beside_itself(self._placed[job].profile):
            self._found_no_other_place(job)
            return None
        undo = self._take_out(job)
        placed, measured = undo.placed, undo.measured
        first = self.place(newcomer, now)
        if isinstance(first, Placement):
            moved = self.place(placed.profile, now)
            if isinstance(moved, Placement):
                if moved.devices == placed.placement.devices and measured is not None:
                    self._measured[job] = measured  # it stays where it was measured
                return moved, first
            self.release(newcomer.job)
        self._put_back(undo)
        if isinstance(first, Placement):
            self._found_no_other_place(job)
        else:
            if self._room_refused[0] != self._releases:
                self._room_refused = (self._releases, set())
            self._room_refused[1].add(key)
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
        moved = self.place(undo.placed.profile, now)
        if isinstance(moved, Placement):
            if (self._row_jobs[self._job_rows[job]] == 1).all():
                return moved
            self.release(job)
        self._put_back(undo)
        self._no_unused[job] = self._releases
        return None

    def may_spread_out(self, job: str) -> bool:
        """Whether `spread_out` would try: the placed job shares a device, some group has as many
        devices unused as it holds, and it was not refused since the last release. Nothing is
        changed by asking (most step boundaries end here)."""
        rows = self._job_rows.get(job)
        if rows is None or not (self._row_jobs[rows] > 1).any() or self._no_unused.get(job) == self._releases:
            return False
        return self._unused()[0].max(initial=0) >= len(rows)

    def _no_place_beside_itself(self, profile: JobProfile) -> bool:
        """Whether placed `profile`'s job would wait wherever it went, its own devices taken
        (by a copy of it, for the bound; a newcomer there would be judged alike): the
        bound of `_refused_everywhere`, a fraction of a try's cost."""
        twin = replace(profile, job=f"{profile.job}\0twin")
        groups = self.view.feasible_groups(twin)
        return len(groups) == 0 or self._refused_everywhere(twin, groups) is not None

    def _take_out(self, job: str) -> _Undo:
        """A tentative move begins: placed `job` is released; returns what `_put_back` needs to
        undo that."""
        undo = _Undo(self._placed[job], self._measured.get(job), self._version, self._releases,
                     dict(self._cotenancy), dict(self._node_tenancy), self._free)
        self.release(job)
        return undo

    def _put_back(self, undo: _Undo) -> None:
        """A tentative move failed: the job is held where it was, as if it had never left (and
        every cache of that state holds again, whatever the tentative states computed)."""
        self._hold(undo.placed)
        if undo.measured is not None:
            self._measured[undo.placed.profile.job] = undo.measured
        self._version, self._releases = undo.version, undo.releases
        self._cotenancy, self._node_tenancy, self._free = undo.cotenancy, undo.node_tenancy, undo.free

    def _found_no_other_place(self, job: str) -> None:
        """`make_room` does not try `job` again before a job is released (`room_if_moved` is 0)."""
        self._no_other_place[job] = self._releases
        self._free[2].pop(job, None)

    def _unused(self) -> tuple[np.ndarray, dict[str, int]]:
        """Devices nobody uses per group, and `room_if_moved`'s answers, as of the latest change."""
        if self._free[0] != self._version:
            self._free = (self._version, np.add.reduceat(self._row_jobs == 0, self._group_bounds[:, 0]), {})
        return self._free[1], self._free[2]

    def reprofile(self, profile: JobProfile) -> None:
        """A placed job's profile is now `profile` (measured), where it is: the same devices and
        phase. What the placer projects and judges from now on rests on it; a re-placement it
        was refused leaves the job running there, and its guess would mislead every decision
        after. Its device count must be the placement's."""
        old, measured = self._placed[profile.job], self._measured.get(profile.job)
        if profile.devices != len(old.placement.devices):
            raise ValueError(f"job {profile.job!r} is placed on {len(old.placement.devices)} devices; a profile "
                             f"of {profile.devices} needs a re-placement")
        self.release(profile.job)
        self._hold(_Placed(profile, old.placement, old.anchor_s))
        if measured is not None:  # measured where it still is: a new profile does not undo that
            self._measured[profile.job] = measured

    def profile_of(self, job: str) -> JobProfile:
        """The profile `job` was placed with (what `drifted` compares a measured one against)."""
        return self._placed[job].profile

    def placements(self) -> dict[str, Placement]:
        return {job: p.placement for job, p in self._placed.items()}

    def inflation_of(self, job: str) -> float:
        """The step inflation the model predicts now for placed `job` with the co-tenants it
        has (see the module docstring); 0.0 for a job alone on its devices."""
        placed = self._placed[job]
        rows = [self.view.device_rows[d] for d in placed.placement.devices]
        tenants = self._tenants(rows, exclude=job) if placed.profile.barriers > 0 else {}
        if _knows_calls(placed.profile, tenants):
            return round(self._call_inflation(placed.profile, tenants, rows), 9)
        h = self.horizon
        in_time = h.columns(h.origin, h.slots)
        mine = h.project(placed.profile, placed.anchor_s, h.origin, h.slots) / len(rows)
        load = h.load[rows][:, in_time]
        return round(max(step_inflation(row - mine, mine, 1.0) for row in load), 9)

    def _tenants(self, rows: list[int], exclude: str | None = None) -> dict[str, tuple[JobProfile, float]]:
        """Jobs with a share on `rows`: (profile, fraction of `rows` they share), in arrival order.
        `pooled`: every job on the groups of `rows` (their calls run on any of its devices)."""
        if self.pooled:
            groups = sorted({int(g) for g in self._row_group[rows]})
            rows = [r for g in groups for r in range(*self.view.group_rows[g])]
        found: dict[str, list] = {}
        for row in rows:
            for job, profile, _, _ in self.horizon.jobs_on(row):
                if job != exclude:
                    found.setdefault(job, [profile, 0])[1] += 1
        return {job: (profile, n / len(rows)) for job, (profile, n) in found.items()}

    def overload_s(self) -> float:
        """Projected overload of the whole cluster over the horizon, in device-seconds."""
        return float(self.horizon.overload_s(np.ones(len(self.horizon.load))).sum())

    # -- the steps of a decision ---------------------------------------------------------------

    def _shift_slots(self, profile: JobProfile) -> np.ndarray:
        distinct = max(1, int(np.ceil(profile.period_s / self.horizon.slot_s - 1e-9)))
        stride = -(-distinct // self.max_shifts)
        return np.arange(0, distinct, stride)

    def _shifted_share(self, profile: JobProfile, now: float, shifts: np.ndarray) -> np.ndarray:
        """share[k, c]: the job's demand per device (1/devices of it) started at now + shifts[k]
        slots, in ring column c.

        One projection over [origin - max shift, origin + H) serves every shift: shifting by k
        slots is reading it k slots earlier, gathered straight into ring order.
        """
        h, top = self.horizon, int(shifts[-1])
        extended = h.project(profile, now, h.origin - top, h.slots + top) / profile.devices
        return extended[(top - shifts)[:, None] + h.positions()[None, :]]

    def _search(self, groups: np.ndarray, profile: JobProfile, share: np.ndarray) -> _Candidate:
        """The best (group, shift, devices), visiting groups in tie order (most carried load
        first, then topology order), so a group must score strictly less than the best so far.

        Exact pruning: a group with enough devices free of hot cells scores 0 at every shift
        (`_all_cool`); once one is known, a group visited before it can only win by scoring 0.
        A group whose lower bound (`_lower_bounds`) cannot beat that is skipped unscored; with
        a cool group ahead only a score of 0 could win, and the cheaper `_may_score_zero`
        decides that.
        """
        self._units = self.view.units_per_node(profile)  # memory does not change during a search
        try:
            return self._visit(groups, profile, share)
        finally:
            self._units = None

    def _visit(self, groups: np.ndarray, profile: JobProfile, share: np.ndarray) -> _Candidate:
        load, peak = self.horizon.load, share.max()
        row_load, row_max = self._row_sums_and_maxima()
        cool_rows = row_max + peak <= 1.0 + _TINY  # no cell where the job could overload
        all_cool = self._all_cool(cool_rows, profile)
        zero_ahead = bool(all_cool[groups].any())
        order, _ = self._tie_order(groups, row_load)
        best: _Candidate | None = None
        for lo_g in range(0, len(order), _BOUND_BLOCK):
            block = [int(g) for g in order[lo_g: lo_g + _BOUND_BLOCK]]
            cut = next((i for i, g in enumerate(block) if all_cool[g]), len(block))
            if zero_ahead:  # only a group that can score 0 may come before a cool one: a cheaper test
                bounds = np.where(self._may_score_zero(block[:cut], share, profile, cool_rows), 0.0, np.inf)
            else:
                bounds = self._lower_bounds(block[:cut], share, profile, cool_rows)
            for g, bound in zip(block[:cut], bounds):
                if (zero_ahead and bound > 0.0) or (best is not None and bound >= best.score):
                    continue
                lo, hi = self.view.group_rows[g]
                costs = self._device_costs(lo, share, load[lo:hi] + peak > 1.0 + _TINY)
                scores = self._group_scores(g, costs, profile)
                k = int(np.argmin(scores))
                if best is None or scores[k] < best.score:
                    best = _Candidate(g, k, float(scores[k]), self._choose(g, costs[:, k], profile))
                if best.score == 0.0:
                    return best
            if cut < len(block):  # enough cool devices: score 0 at shift 0, on devices costing 0
                g = block[cut]
                lo, hi = self.view.group_rows[g]
                cost = self._device_costs(lo, share[:1], load[lo:hi] + peak > 1.0 + _TINY)[:, 0]
                return _Candidate(g, 0, 0.0, self._choose(g, cost, profile))
        return best

    def _row_sums_and_maxima(self) -> tuple[np.ndarray, np.ndarray]:
        """Each row's summed load and its largest cell: `load.sum(axis=1)` and `load.max(axis=1)`
        bit for bit (each row reduced alone, the same way), passing over occupied rows only
        (an empty row holds only 0.0): by runs of consecutive ones (packing keeps them few),
        or as one gathered copy when they are fragmented."""
        load, occupied = self.horizon.load, self._row_jobs > 0
        sums, maxima = np.zeros(len(load)), np.zeros(len(load))
        runs = np.flatnonzero(np.diff(occupied, prepend=False, append=False)).reshape(-1, 2)
        if len(runs) > _MAX_RUNS:
            rows = np.flatnonzero(occupied)
            sums[rows], maxima[rows] = load[rows].sum(axis=1), load[rows].max(axis=1)
            return sums, maxima
        for a, b in runs.tolist():
            sums[a:b], maxima[a:b] = load[a:b].sum(axis=1), load[a:b].max(axis=1)
        return sums, maxima

    def _all_cool(self, cool_rows: np.ndarray, profile: JobProfile) -> np.ndarray:
        """Per group: its nodes have enough whole replicas of devices without a hot cell (within
        host room), so the job scores 0 there at every shift."""
        cool = np.add.reduceat(cool_rows.astype(np.int64), self._node_first_row) // profile.replica_devices
        units = np.minimum(cool, self._units) * profile.replica_devices
        return np.add.reduceat(units, self.view.group_first_node) >= profile.devices

    def _may_score_zero(self, groups: list[int], share: np.ndarray, profile: JobProfile,
                        cool_rows: np.ndarray) -> np.ndarray:
        """Per group: False where it scores above 0 at every shift (exact pruning), found on the
        probe columns (`_probe_room`). A device overloaded on some cell by more than
        1e-6 / slot_s costs at least 1e-6 device-seconds, which its rounding keeps; a group with
        fewer than `devices` devices free of such a probe cell at a shift must use one there.
        A cool row has no hot cell: it is free at every shift."""
        if not groups:
            return np.zeros(0, dtype=bool)
        spans, warm, room, cols = self._probe_room(groups, share, cool_rows, _evenly_and_scattered)
        free = np.ones((len(share), len(warm)), dtype=bool)  # (shifts, rows)
        free[:, warm] = _fits_on_probes(share[:, cols], room + 1e-6 / self.horizon.slot_s)
        starts = np.cumsum([0] + [b - a for a, b in spans[:-1]])
        return (np.add.reduceat(free, starts, axis=1) >= profile.devices).any(axis=0)

    def _lower_bounds(self, groups: list[int], share: np.ndarray, profile: JobProfile,
                      cool_rows: np.ndarray) -> np.ndarray:
        """A lower bound of each group's best score over all shifts: each device's overload on
        the probe columns (`_probe_room`), then the job's cheapest devices per group, ignoring
        nodes. Spread samples refute a zero score
        about as well as every cell does when periods differ; either way the bound prunes
        exactly. One vector pass for all `groups`; a cool row costs 0 at every shift."""
        if not groups:
            return np.zeros(0)
        spans, warm, room, cols = self._probe_room(groups, share, cool_rows, _evenly)
        over = share[:, None, cols] - room[None]  # (shifts, warm rows, probes)
        per_row = np.zeros((len(share), len(warm)))
        per_row[:, warm] = np.maximum(over, 0.0, out=over).sum(axis=2) * self.horizon.slot_s
        # per group, the job's `devices` cheapest rows at each shift (groups padded with +inf)
        width = max(b - a for a, b in spans)
        padded = np.full((len(share), len(groups), width), np.inf)
        where = np.concatenate([i * width + np.arange(b - a) for i, (a, b) in enumerate(spans)])
        padded.reshape(len(share), -1)[:, where] = per_row
        need = profile.devices
        cheapest = np.partition(padded, need - 1, axis=2)[:, :, :need].sum(axis=2).min(axis=0)
        # rounded like the scores; a micro device-second less leaves room for their rounding
        return np.round(cheapest - 1e-6, 6)

    def _probe_room(self, groups: list[int], share: np.ndarray, cool_rows: np.ndarray, pick
                    ) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray, np.ndarray]:
        """(each group's row span, which of the groups' rows are warm, room[w, p], the probe
        columns): the groups' hot columns that `pick` takes, and each warm row's room on them
        (1 - load on a hot cell; +inf where the job cannot overload it). Only warm rows (not
        `cool_rows`) have hot cells; cool ones are not read."""
        spans = [self.view.group_rows[g] for g in groups]
        rows = np.concatenate([np.arange(a, b) for a, b in spans])
        warm = ~cool_rows[rows]
        load = self.horizon.load[rows[warm]]
        peak, threshold = share.max(), 1.0 + _TINY
        # a column is hot on some row iff on the row with its largest load (adding is monotone)
        cols = pick(np.flatnonzero(load.max(axis=0, initial=-np.inf) + peak > threshold))
        at = load[:, cols]
        return spans, warm, np.where(at + peak > threshold, 1.0 - at, np.inf), cols

    def _device_costs(self, first_row: int, share: np.ndarray, hot: np.ndarray) -> np.ndarray:
        """cost[d, k]: overload device-seconds on row first_row + d with the job's share shifted
        by shifts[k], from hot cells only (the others cannot overload at any shift).

        A row's cost depends on its load and hot cells alone, and the devices of a group mostly
        carry the same jobs (a job puts one share on each of its devices), so each distinct
        load row (its hot cells follow from it) is costed once and copied to its twins: the same
        numbers, the same operations in the same order per row, as costing every row (tested
        against that)."""
        load = self.horizon.load[first_row: first_row + len(hot)]
        twin: dict[bytes, int] = {}  # a row's load bytes -> the number of its distinct row
        of_row = [twin.setdefault(row.tobytes(), len(twin)) for row in load]
        if len(twin) == len(hot):
            return self._row_costs(first_row, share, hot)
        first = np.unique(of_row, return_index=True)[1]  # each distinct row's first row, in number order
        return self._row_costs(first_row, share, hot, first)[of_row]

    def _row_costs(self, first_row: int, share: np.ndarray, hot: np.ndarray,
                   only: np.ndarray | None = None) -> np.ndarray:
        """`_device_costs` computed row by row for every row of `hot`, or for the rows `only`
        (offsets from first_row; the result then has one row per entry of `only`)."""
        if only is not None:
            hot = hot[only]
        costs = np.zeros((len(hot), len(share)))
        rows, cols = np.nonzero(hot)
        if len(rows) == 0:
            return costs
        absolute = first_row + (rows if only is None else only[rows])
        base = self.horizon.load[absolute, cols] - 1.0
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        per_chunk = max(1, _CHUNK_CELLS // len(rows))
        for lo in range(0, len(share), per_chunk):
            over = np.take(share[lo: lo + per_chunk], cols, axis=1)
            over += base
            np.maximum(over, 0.0, out=over)
            costs[rows[starts], lo: lo + len(over)] = np.add.reduceat(over, starts, axis=1).T
        # rounding to a micro device-second turns float residue into exact zeros and ties
        return np.round(costs * self.horizon.slot_s, 6)

    def _group_scores(self, group: int, costs: np.ndarray, profile: JobProfile) -> np.ndarray:
        """score[k]: the least total cost of the job's devices in `group` at shift k, in whole
        replicas per node within each node's host room (see the module docstring, step 3)."""
        size, lo = profile.replica_devices, self.view.group_rows[group][0]
        units = []
        for node, cap in self._node_units(group, profile):
            a, b = self.view.node_rows[node]
            ordered = np.sort(costs[a - lo: b - lo], axis=0)[: cap * size]
            units.append(ordered.reshape(cap, size, -1).sum(axis=1))
        units = np.concatenate(units)
        need = profile.devices // size
        return np.round(np.partition(units, need - 1, axis=0)[:need].sum(axis=0), 6)

    def _choose(self, group: int, cost: np.ndarray, profile: JobProfile) -> tuple[int, ...]:
        """The job's device rows in `group` for one shift's per-device `cost`: the choice
        `_group_scores` scored, equal costs going to less carried load, then the lower row."""
        size, lo = profile.replica_devices, self.view.group_rows[group][0]
        carried = np.round(self.horizon.load[lo: self.view.group_rows[group][1]].sum(axis=1), 6)
        units = []  # (cost, carried, first row, rows)
        for node, cap in self._node_units(group, profile):
            a, b = self.view.node_rows[node]
            ordered = sorted(range(a - lo, b - lo), key=lambda d: (cost[d], carried[d], d))[: cap * size]
            for i in range(0, len(ordered), size):
                unit = ordered[i: i + size]
                units.append((sum(cost[unit]), sum(carried[unit]), unit[0], unit))
        units.sort(key=lambda u: u[:3])
        return tuple(sorted(lo + d for u in units[: profile.devices // size] for d in u[3]))

    def _node_units(self, group: int, profile: JobProfile) -> list[tuple[int, int]]:
        """(node, replicas it can take) for the group's nodes that can take any."""
        first = int(self.view.group_first_node[group])
        units = self._units if self._units is not None else self.view.units_per_node(profile)
        return [(n, int(units[n])) for n in range(first, first + len(self.view.groups[group].nodes)) if units[n] > 0]

    def _tie_order(self, groups: np.ndarray, row_load: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`groups` in the search's tie order (most carried load first, then topology order),
        with the load each carries (`_carried`), in that order."""
        carried = self._carried(groups, row_load)
        order = np.lexsort((groups, -carried))
        return groups[order], carried[order]

    def _carried(self, groups: np.ndarray, row_load: np.ndarray) -> np.ndarray:
        """Projected demand already on each group (rounded so float residue cannot break ties)."""
        bounds = self._group_bounds[groups]
        per_row = np.concatenate(([0.0], np.cumsum(row_load)))
        return np.round(per_row[bounds[:, 1]] - per_row[bounds[:, 0]], 6)

    def _judge(self, profile: JobProfile, best: _Candidate, shift: int, share: np.ndarray,
               align_s: float = 0.0) -> Placement | Wait:
        h = self.horizon
        rows = list(best.rows)
        tenants = self._tenants(rows) if profile.barriers > 0 else {}  # only the call model reads them
        calls = _knows_calls(profile, tenants)
        if calls:
            inflation = self._call_inflation(profile, tenants, rows)
        else:
            inflation = max(step_inflation(h.load[r], share, 1.0) for r in rows)
        name = self.view.groups[best.group].name
        where = (f"even the best placement (group {name!r}, phase shift {shift * h.slot_s:g} s) projects "
                 f"{best.score:.1f} device-s of overload over the horizon")
        limit = self._limit(profile, self._tenants_end(rows))
        if inflation > limit:
            return Wait(f"job {profile.job!r} would be slowed by {inflation:.0%}, beyond its slack of "
                        f"{limit:.0%}: {where}")
        hurt = self._hurt_by_waits(profile, rows, tenants) if calls else self._hurt_tenant(profile, rows, share)
        if hurt is not None:
            tenant, slowed, slack = hurt
            return Wait(f"job {profile.job!r} would slow job {tenant!r} by {slowed:.0%}, beyond its slack of "
                        f"{slack:.0%}: {where}")
        devices = tuple(int(self.view.row_device[r]) for r in rows)
        return Placement(name, shift * h.slot_s + align_s, best.score, devices, inflation)

    def _tenants_end(self, rows: list[int]) -> bool:
        """Whether every job placed on `rows` ends (at once when every placed job does)."""
        return self._open_ended == 0 or all(self._placed[j].profile.ends for r in rows for j in self.horizon.names_on(r))

    def _hurt_tenant(self, newcomer: JobProfile, rows: list[int], share: np.ndarray) -> tuple[str, float, float] | None:
        """The first job sharing a device of `rows` that the newcomer's `share` (ring order)
        would push beyond its slack, with its inflation and slack; a job already beyond it
        before only counts if the newcomer makes it worse."""
        h, seen = self.horizon, set()
        in_time = h.columns(h.origin, h.slots)
        for row in rows:
            for job, profile, anchor, tenant_rows in h.jobs_on(row):
                if job in seen:
                    continue
                seen.add(job)
                mine = h.project(profile, anchor, h.origin, h.slots) / len(tenant_rows)
                before = h.load[list(tenant_rows)][:, in_time]
                after = before + np.isin(tenant_rows, rows)[:, None] * share[in_time]
                slowed = max(step_inflation(a - mine, mine, 1.0) for a in after)
                was = max(step_inflation(b - mine, mine, 1.0) for b in before)
                limit = self._limit(profile, newcomer.ends)
                if slowed > max(limit, was) + _TINY:
                    return job, slowed, limit
        return None

    def _hurt_by_waits(self, newcomer: JobProfile, rows: list[int],
                       tenants: dict[str, tuple[JobProfile, float]]) -> tuple[str, float, float] | None:
        """`_hurt_tenant` under the call model: each tenant's inflation with the newcomer's
        calls added on the devices they share, on top of what the tenant was measured at
        (`observe`) or else predicted to have."""
        mine = set(rows)
        for job, (profile, _) in tenants.items():
            own = self._rows_of(self._placed[job])
            slowed = self._pushed(newcomer, job, len(mine.intersection(own)) / len(own))
            if slowed is not None:
                return job, slowed, self._limit(profile, newcomer.ends)
        return None

    def _refused_everywhere(self, profile: JobProfile, groups: np.ndarray) -> Wait | None:
        """Wait, without a search, when `_judge` would refuse every devices the search could
        choose, whichever wins; None when some might pass (then the search decides). Exact,
        under the call model only (every job involved knows its calls):
        - the newcomer's own inflation: with fewer than `devices` rows whose tenants could each
          take turns with it (`_interleave`, its busy-share sum with a margin: a set
          interleaves only if each subset does), no candidate interleaves, so its inflation is
          the wait of `wait_inflation` over every tenant of its rows, at least what the
          tenants of the `devices`-th least-waiting row alone make (each tenant's wait at least
          `_least_wait`); a bound above the slack it is judged by (by a margin) refuses them all
          (`_limit`; while an open-ended job is placed, its own slack: no less than anywhere);
        - a row is barred when a tenant on it would be pushed past its slack by sharing even
          one of its devices with the newcomer (`_hurt_by_waits` at the least share; what it
          adds does not shrink with the share); the unbarred rows are bounded as above.
        Rows on nodes without host room for a replica are never chosen, so they are skipped."""
        if profile.barriers <= 0 or not self._placed or self.pooled:  # the bound is of pinned devices
            return None
        if any(p.profile.barriers <= 0 for p in self._placed.values()):
            return None
        limit = self._limit(profile, self._open_ended == 0)  # at least what `_judge` allows anywhere
        barred: dict[str, bool] = {}
        cells: dict[tuple[str, ...], tuple[tuple[float, bool], str | None]] = {}  # a row's jobs -> (cell, barring job)
        units = self.view.units_per_node(profile)
        least, tenant = math.inf, ""  # the least bound of groups refused for the newcomer's own inflation
        hurts = mixed = False  # some group refused for a co-tenant's sake; for one reason or the other
        for g in groups:
            first = int(self.view.group_first_node[g])
            every, unbarred = [], []  # (wait, takes turns) per usable row
            for node in range(first, first + len(self.view.groups[g].nodes)):
                if units[node] <= 0:
                    continue
                for names, rows in self._tenancies(node):
                    if names not in cells:  # rows with the same jobs wait alike and are barred alike
                        tenants = [self._placed[j].profile for j in names]
                        cell = (sum(_least_wait(profile, t) for t in tenants),
                                _interleave(profile, tenants, margin=1e-9))
                        cells[names] = cell, next((j for j in names if self._bars(profile, j, barred)), None)
                    cell, hurt = cells[names]
                    every += [cell] * rows
                    if hurt is None:
                        unbarred += [cell] * rows
                    else:
                        tenant = tenant or hurt
            bound = self._own_bound(profile, every)
            if bound > limit + 1e-9:
                least = min(least, bound)
            elif self._own_bound(profile, unbarred) <= limit + 1e-9:
                return None
            elif len(unbarred) < profile.devices:
                hurts = True
            else:
                mixed = True
        where = "on any devices where its memory fits"
        if not (hurts or mixed):
            return Wait(f"job {profile.job!r} would be slowed by {least:.0%} or more, beyond its slack of "
                        f"{limit:.0%}, {where}")
        if not (mixed or least < math.inf):
            return Wait(f"job {profile.job!r} would slow job {tenant!r} or another co-tenant beyond its slack {where}")
        return Wait(f"job {profile.job!r} would be slowed beyond its slack of {limit:.0%} or slow a "
                    f"co-tenant beyond theirs (e.g. job {tenant!r}) {where}")

    def _tenancies(self, node: int) -> list[tuple[tuple[str, ...], int]]:
        """The distinct sets of jobs on `node`'s rows (`Horizon.names_on`), in the order of
        their first row, with how many rows carry each; kept until the placements change (a
        queue retried on one release asks about the same nodes for every waiting job)."""
        found = self._node_tenancy.get(node)
        if found is None:
            counts: dict[tuple[str, ...], int] = {}
            for row in range(*self.view.node_rows[node]):
                names = self.horizon.names_on(row)
                counts[names] = counts.get(names, 0) + 1
            found = self._node_tenancy[node] = list(counts.items())
        return found

    def _own_bound(self, profile: JobProfile, rows: list[tuple[float, bool]]) -> float:
        """A lower bound of the newcomer's inflation on any `devices` of `rows`, (the least it
        waits per step for the row's tenants, `_least_wait`; whether they may take turns with
        it) each: 0 when enough may take turns, +inf when there are too few rows (see
        `_refused_everywhere`)."""
        need = profile.devices
        if len(rows) < need:
            return math.inf
        if sum(turns for _, turns in rows) >= need:
            return 0.0
        # the tenants of any `need` rows include those of each, so they wait at least what
        # the need-th least-waiting row's tenants alone make it wait
        return sorted(wait for wait, _ in rows)[need - 1] / profile.period_s

    def _bars(self, newcomer: JobProfile, job: str, memo: dict[str, bool]) -> bool:
        """Whether placed `job` would be pushed past its slack by the newcomer on one of its
        devices (`_hurt_by_waits` at the least share), memoised in `memo` for one decision."""
        if job not in memo:
            memo[job] = self._pushed(newcomer, job, 1 / len(self._placed[job].placement.devices)) is not None
        return memo[job]

    def _pushed(self, newcomer: JobProfile, job: str, shared: float) -> float | None:
        """Placed `job`'s inflation with the newcomer's calls on `shared` of its devices, on top
        of what it was measured at (`observe`) or else predicted to have, when that pushes it
        past its slack (or further past it); None when it does not."""
        profile = self._placed[job].profile
        others, before = self._cotenants(job)
        with_newcomer = {**others, newcomer.job: (newcomer, shared)}
        added = self._call_inflation(profile, with_newcomer, self._rows_of(self._placed[job])) - before
        was = self._measured.get(job, before)
        return was + added if was + added > max(self._limit(profile, newcomer.ends), was) + _TINY else None

    def _cotenants(self, job: str) -> tuple[dict[str, tuple[JobProfile, float]], float]:
        """(`_tenants` of placed `job`'s devices, the inflation they give it under the call model),
        kept until the placements change (`_hold`, `release`): a queue retried on one release
        asks again for the same jobs."""
        if job not in self._cotenancy:
            rows = self._rows_of(self._placed[job])
            others = self._tenants(rows, exclude=job)
            self._cotenancy[job] = others, self._call_inflation(self._placed[job].profile, others, rows)
        return self._cotenancy[job]

    def _call_inflation(self, profile: JobProfile, tenants: dict[str, tuple[JobProfile, float]],
                        rows: list[int]) -> float:
        """The call model's inflation of `profile`'s job on `rows` among `tenants` (`_tenants`):
        `pooled_inflation` over the devices of its group when `pooled`, else `wait_inflation`."""
        if self.pooled:
            devices = int(self.view.capacity[int(self._row_group[rows[0]])])
            return pooled_inflation(profile, [t for t, _ in tenants.values()], devices)
        return wait_inflation(profile, tenants.values(), self._inflation_memo)

    def _hold(self, placed: _Placed) -> None:
        job, p = placed.profile.job, placed.placement
        self.view.allocate(job, p.devices, placed.profile.host_bytes_per_device, placed.profile.shared_host_bytes)
        rows = self._rows_of(placed)
        self.horizon.add(job, rows, placed.profile, placed.anchor_s)
        self._job_rows[job] = np.array(rows, dtype=np.int64)
        self._row_jobs[rows] += 1
        self._placed[job] = placed
        self._open_ended += not placed.profile.ends
        self._cotenancy.clear()
        self._node_tenancy.clear()
        self._version += 1

    def _rows_of(self, placed: _Placed) -> list[int]:
        return [self.view.device_rows[d] for d in placed.placement.devices]


def wait_inflation(profile: JobProfile, tenants, memo: dict | None = None) -> float:
    """Step inflation of `profile`'s job from sharing devices with `tenants`, (profile,
    fraction of the job's devices shared) pairs; a tenant counts whole on any share (see the
    module docstring; each wait is `wait_s`: elastic rollout turns share a tenant's rollouts'
    replicas instead of waiting for them). Jobs whose device
    busy shares sum to at most 1 interleave (each collision pushes the later one into the
    other's idle time) and lock onto the slowest period; others meet at random phases and
    wait for the rest of the call they find, and for the calls of tenants queued ahead
    (`_queued_ahead`). `memo` keeps answers across calls (a placer's: it asks about the same
    sets of jobs in decision after decision); by default one call's."""
    tenants = [tenant for tenant, fraction in tenants if fraction > 0]
    if not tenants:
        return 0.0
    return _inflations((profile, *tenants), {} if memo is None else memo)[0]


_QUEUED_TENANTS = 4  # beyond this many tenants, the first-order wait only (2^n subsystems otherwise)
_MEMO_ENTRIES = 1 << 16  # an `_inflations` memo kept across calls is emptied when it holds this many


def _inflations(jobs: tuple[JobProfile, ...], memo: dict) -> list[float]:
    """Each job's inflation among `jobs`, all on the same devices: `wait_inflation`'s rules.

    Queued ahead (the arrival theorem of closed queueing networks, for one call of each job at a
    time): a phase of job x arriving at the device finds the others as they are in the system
    without x. Each other job k is then mid-call (the rest of its call: `residual_s`, its busy
    share thinned by how much the others slow it there, 1 / (1 + i_k)) or queued, waiting for
    a device (the share i_k / (1 + i_k) of its slowed step), and then x waits for k's whole call
    too (its mean phase, busy / barriers), first come first served. With one co-tenant this is
    the first-order wait. Without the queued term, three tenants on a device are under-predicted
    nearly always: a phase waiting for a second job's call also waits for a third's queued ahead.
    More than `_QUEUED_TENANTS` tenants: the first-order wait only.

    `memo` maps the ids of a set's profiles to (the profiles, their inflations): the answer is a
    function of the profiles alone, and the entry keeps them alive, so no id in its key can
    be another profile's while it stands."""
    key = tuple(map(id, jobs))
    hit = memo.get(key)
    if hit is not None:
        return hit[1]
    if len(jobs) == 1:
        out = [0.0]
    elif len(jobs) == 2:
        out = list(_pair_inflations(*jobs))
    elif _interleave(jobs[0], list(jobs[1:])):  # the same for every job of the set
        slowest = max(job.period_s for job in jobs)
        out = [max(0.0, slowest / job.period_s - 1.0) for job in jobs]
    else:
        out = []
        for x, job in enumerate(jobs):
            others = jobs[:x] + jobs[x + 1:]
            if len(others) > _QUEUED_TENANTS:
                out.append(sum(wait_s(job, t) for t in others) / job.period_s)
                continue
            without = _inflations(others, memo)  # the others as x finds them
            wait = sum(wait_s(job, t, 1 / (1 + i), _queued_ahead(t, i)) for t, i in zip(others, without))
            out.append(wait / job.period_s)
    out = _conserving([_busy_s(j) / j.period_s for j in jobs], out, 1.0)
    if len(memo) >= _MEMO_ENTRIES:
        memo.clear()
    memo[key] = (jobs, out)
    return out


def _conserving(busy: list[float], inflations: list[float], capacity: float) -> list[float]:
    """`inflations` of jobs that keep `busy` devices busy alone (on average; each on the same
    devices, or a pool of `capacity`), raised where the devices would have to run more than all
    the time: slowed, a job keeps b / (1 + i) of them busy, and those cannot sum past `capacity`.
    Past it every (1 + i) is stretched by the same factor, the sum over `capacity`, so they sum
    to it (two jobs busy 75% each run 50% slow or more, however short their calls)."""
    load = sum(b / (1.0 + i) for b, i in zip(busy, inflations)) / capacity
    if load <= 1.0:
        return inflations
    return [(1.0 + i) * load - 1.0 for i in inflations]


def wait_s(job: JobProfile, tenant: JobProfile, scale: float = 1.0, queued: float = 0.0) -> float:
    """Seconds per step `job` waits for `tenant` on the devices they share: each of its phases
    waits for the rest of the tenant's call it finds running (`residual_s`, times `scale`: the
    share of time the tenant is found running rather than queued) and for the tenant's calls
    queued ahead (`queued`). An elastic rollout turn of the job (`JobProfile.rollout_barriers`)
    does not wait for the tenant's rollouts: it takes a share of their replicas (`sim/rollout.py`,
    `policy.share_replicas`), so it waits only for the rest of the tenant's other calls, and its
    time on all its replicas (`rollout_s`) is slowed while the tenant's rollouts want all theirs
    too (the share of the tenant's step they do, `rollout_s / period_s`): the two then split the
    replicas, and its decoding in that overlap takes twice as long. Without rollouts known (a
    runtime's measured profile, pinned rollouts) this is `barriers * residual_s` (first order)."""
    calls = job.barriers - job.rollout_barriers
    wait = calls * (tenant.residual_s * scale + queued)
    if job.rollout_barriers:
        others = max(0.0, tenant.residual_s - tenant.rollout_residual_s)
        wait += job.rollout_barriers * (others * scale + queued)
        wait += job.rollout_s * tenant.rollout_s / tenant.period_s * scale
    return wait


def _least_wait(newcomer: JobProfile, tenant: JobProfile) -> float:
    """A lower bound of what `newcomer` waits per step for `tenant`, with any others: `wait_s`
    first order alone, and with others (`_inflations`) with its rests and overlap scaled by
    s = 1 / (1 + i) and the tenant's mean phase queued ahead for each barrier with weight 1 - s.
    That is linear in s, so over any i >= 0 it is at least the smaller of its ends: the first
    order (s = 1) and every barrier waiting one mean phase (s -> 0)."""
    if tenant.barriers <= 0:
        return wait_s(newcomer, tenant)
    return min(wait_s(newcomer, tenant), newcomer.barriers * _mean_phase_s(tenant))


def _queued_ahead(job: JobProfile, inflation: float) -> float:
    """The expected wait for `job`'s calls queued ahead: the share of its slowed step it waits
    for a device, times its mean phase."""
    if job.barriers <= 0:
        return 0.0
    return inflation / (1 + inflation) * _mean_phase_s(job)


def _mean_phase_s(job: JobProfile) -> float:
    """Seconds of one of the job's phases on a device, on average (busy time per barrier)."""
    return _busy_s(job) / job.barriers


def pooled_inflation(profile: JobProfile, tenants, devices: int) -> float:
    """Step inflation of `profile`'s job among `tenants` (profiles) on a pool of `devices` that
    run any tenant's call on whichever is free (a runtime's group scheduler: states float over
    their group's devices). A phase of the job waits only when its co-tenants' calls hold every
    device: with their relative phases uniform, co-tenant k holds n devices with the chance its
    demand profile spends there (a slot of fractional demand d holding floor(d) or floor(d) + 1),
    independently of the others, and the phase waits for the first of the held devices to
    free, the rest of a call of mean `_mean_rest_s` each, as if memoryless (the least of
    several residuals: 1 / sum 1/rest). Two one-call-at-a-time jobs on two devices never wait
    for each other; a third waits only while both others run. First order as `wait_inflation`
    (a phase that needs several devices is taken to wait for one). The jobs together are held to
    the pool's capacity (`_conserving`: three jobs busy 90% each run 35% slow on two devices or
    more, whatever their waits)."""
    tenants = [t for t in tenants if t.busy_device_s > 0]
    if not tenants or profile.barriers <= 0:
        return 0.0
    jobs = [profile, *tenants]
    waits = [_pooled_wait(job, jobs[:k] + jobs[k + 1:], devices) for k, job in enumerate(jobs)]
    return _conserving([j.busy_device_s / j.period_s for j in jobs], waits, float(devices))[0]


def _pooled_wait(profile: JobProfile, tenants: list[JobProfile], devices: int) -> float:
    """`pooled_inflation`'s wait of `profile`'s job for `tenants` (busy ones) to free a device."""
    if profile.barriers <= 0:
        return 0.0
    held = np.ones(1)  # held[n]: chance the co-tenants hold n devices at a random moment
    for tenant in tenants:
        held = np.convolve(held, _occupancy(tenant))
    blocked = float(held[devices:].sum())
    rests = [rest for rest in map(_mean_rest_s, tenants) if rest > 0]
    rest = 1.0 / sum(1.0 / r for r in rests) if rests else 0.0
    return profile.barriers * blocked * rest / profile.period_s


def _occupancy(profile: JobProfile) -> np.ndarray:
    """p[n]: the chance the job's calls hold n devices at a moment of its step drawn uniformly."""
    demand = np.minimum(np.asarray(profile.demand), profile.devices)
    low = np.floor(demand).astype(np.int64)
    frac = demand - low
    p = np.zeros(profile.devices + 2)
    np.add.at(p, low, 1.0 - frac)
    np.add.at(p, low + 1, frac)
    return p[: profile.devices + 1] / len(demand)


def _mean_rest_s(profile: JobProfile) -> float:
    """The mean rest of the job's call found running at a random moment: sum r^2 / (2 sum r)."""
    busy = _busy_s(profile)
    return profile.residual_s * profile.period_s / busy if busy > 0 else 0.0


def _interleave(profile: JobProfile, tenants: list[JobProfile], margin: float = 0.0) -> bool:
    """Whether the jobs can take turns on their devices: their busy shares sum to at most 1
    (+ `margin`) and, with three or more, for each one the others' busy time per device
    together fits in its longest idle stretch (each of three jobs fitting another's gap alone is
    not enough: three code jobs of 31% busy share whose rollouts each fit a sandbox gap, but
    not two of them, ran 46% slow where pairwise fits predicted 0-11%). Two jobs may take turns
    whenever their shares fit (`_pair_inflations`)."""
    jobs = [profile, *tenants]
    if sum(_busy_s(j) / j.period_s for j in jobs) > 1.0 + margin:
        return False
    if len(jobs) == 2:
        return True
    busy = [_busy_s(j) for j in jobs]
    total = sum(busy)
    return all(total - mine <= _idle_gap_s(j) for j, mine in zip(jobs, busy))


def _pair_inflations(a: JobProfile, b: JobProfile) -> tuple[float, float]:
    """(a's inflation, b's) when the two share devices. Meeting at random phases, each of a job's
    barriers waits for the rest of the other's call found running (`residual_s`). When their busy
    shares fit the devices (`_interleave`) they may take turns instead: each runs its busy time
    while the other idles, and after its longest idle stretch waits for the rest of the other's
    busy time; the faster is held to the slower. Where each busy time fits the other's stretch
    they always take turns (each collision pushes the later one into the other's idle time).
    Where it overflows a little, the pair takes turns when that slows them less than meeting
    at random: two code-7b jobs, each busy ~620 s of a ~1,300 s step around a ~610 s sandbox
    gap, were predicted at 22-26% meeting at random and ran 4-9% slow; taking turns they lock
    at 1-3%."""
    at_random = (wait_s(a, b) / a.period_s, wait_s(b, a) / b.period_s)
    if not _interleave(a, [b]):
        return at_random
    a_over, b_over = max(0.0, _busy_s(b) - _idle_gap_s(a)), max(0.0, _busy_s(a) - _idle_gap_s(b))
    period = max(a.period_s + a_over, b.period_s + b_over)
    turns = (period / a.period_s - 1.0, period / b.period_s - 1.0)
    if a_over <= 0.0 and b_over <= 0.0:
        return turns
    return turns if max(turns) < max(at_random) else at_random


def _evenly(cols: np.ndarray) -> np.ndarray:
    """Up to about `_PROBES` of `cols`, at an even stride."""
    return cols[:: max(1, len(cols) // _PROBES)]


def _evenly_and_scattered(cols: np.ndarray) -> np.ndarray:
    """`_evenly`'s probes and `_PROBES` more at golden-ratio positions. An even stride close to
    a multiple of the job's period reads its profile at one phase only: at a shift that puts
    that phase idle every probe passes, so groups it cannot use are scored in full (a 21-slot
    job among 1,024 hot columns: 45 groups). Any columns prune `_may_score_zero` exactly, and
    these are a superset of `_evenly`'s, so it prunes every group it pruned with those."""
    if len(cols) <= _PROBES:
        return cols
    scattered = (np.arange(1, _PROBES + 1) * _GOLDEN % 1.0 * len(cols)).astype(np.int64)
    # scattered first: `_fits_on_probes` tests its head on all pairs, and these spread from the first
    return cols[np.concatenate((scattered, np.arange(0, len(cols), len(cols) // _PROBES)))]


def _fits_on_probes(share: np.ndarray, room: np.ndarray) -> np.ndarray:
    """fits[k, w]: share[k, p] <= room[w, p] on every probe p. Most (shift, row) pairs fail
    on the first few probes, so only the pairs that pass those are tested on the rest (when
    they are few: gathering them costs more than testing every pair)."""
    head = min(_HEAD_PROBES, share.shape[1])
    fits = ~(share[:, None, :head] > room[None, :, :head]).any(axis=2)
    if head == share.shape[1]:
        return fits
    k, w = np.nonzero(fits)
    if len(k) > fits.size // 4:
        return fits & ~(share[:, None, head:] > room[None, :, head:]).any(axis=2)
    fits[k, w] = ~(share[k, head:] > room[w, head:]).any(axis=1)
    return fits


def _busy_s(profile: JobProfile) -> float:
    """Seconds per step that one of the job's devices is busy."""
    return profile.busy_device_s / profile.devices


@functools.lru_cache(maxsize=4096)
def _idle_gap_s(profile: JobProfile) -> float:
    """The longest stretch of a step (wrapping into the next) in which the job uses no device."""
    idle = np.asarray(profile.demand) <= _TINY
    if idle.all():
        return profile.period_s
    run = best = 0
    for slot_idle in np.concatenate([idle, idle]):
        run = run + 1 if slot_idle else 0
        best = max(best, run)
    return best * profile.slot_s


def _knows_calls(profile: JobProfile, tenants: dict[str, tuple[JobProfile, float]]) -> bool:
    return profile.barriers > 0 and all(t.barriers > 0 for t, _ in tenants.values())


def step_inflation(load: np.ndarray, demand: np.ndarray, capacity: float) -> float:
    """Estimated step inflation of a job with `demand` joining `load` on `capacity` devices,
    slot by slot (fluid sharing, see the module docstring)."""
    busy = demand.sum()
    if busy <= 0:
        return 0.0
    overload = np.maximum(load + demand - capacity, 0.0)
    return float((demand * overload).sum() / capacity / busy)


class FirstFit(Placer):
    """Baseline: the first group (in topology order) that takes the job, phase shift 0, the
    devices with the fewest jobs (`ResourceView.choose_devices`). A group takes it when its
    memory fits and the placement keeps every job within what it is judged by (`_judge`);
    when none does, the job waits for the reason the first memory-feasible group gives. (A
    group refused by the slack check is passed over, as first fit passes over a full bin: a
    job does not wait for a shared group while a later one is free.)"""

    def _shift_slots(self, profile: JobProfile) -> np.ndarray:
        return np.zeros(1, dtype=np.int64)

    def _search(self, groups: np.ndarray, profile: JobProfile, share: np.ndarray) -> _Candidate:
        first = None
        for g in groups:
            candidate = self._candidate(int(g), profile, share)
            if isinstance(self._judge(profile, candidate, 0, share[0]), Placement):
                return candidate
            first = first or candidate
        return first

    def _candidate(self, g: int, profile: JobProfile, share: np.ndarray) -> _Candidate:
        rows = tuple(self.view.device_rows[d] for d in self.view.choose_devices(g, profile))
        lo = min(rows)
        hot = self.horizon.load[lo: max(rows) + 1] + share.max() > 1.0 + _TINY
        costs = self._device_costs(lo, share, hot)
        return _Candidate(g, 0, float(np.round(costs[[r - lo for r in rows], 0].sum(), 6)), rows)
