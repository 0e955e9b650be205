"""The judgement of a placement: whether the step inflation it predicts (`cotenancy.py`)
keeps the job and every job it would share devices with within what each is judged by, and
the `Wait` that says why not.

A job waits when the choice would exceed its own slack or push a co-tenant beyond theirs; a
job whose run ends (`JobProfile.ends`) is judged by at most `pack_limit` among tenants that
end too ("Packing when it pays", below). Only the search's best candidate is judged: no
second-best search.

Measured inflation feeds back (`Placer.observe`): a tenant whose measured inflation is known is
judged by it plus what the newcomer adds, so a group whose tenants run under their
predictions may take more, and one with a tenant past its slack takes nobody onto its devices.

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

Invariants: a judgement changes nothing (the placer commits what it accepts); a profile
without calls (`JobProfile.barriers` 0), or among tenants without them, is judged by the fluid
model (`cotenancy.step_inflation`), every other by the call model.
"""

from __future__ import annotations

import numpy as np

from plexrl.policy.placement.cotenancy import TINY, knows_calls, pooled_inflation, step_inflation, wait_inflation
from plexrl.policy.placement.decisions import Placement, Wait
from plexrl.policy.placement.search import Candidate
from plexrl.policy.placement.tenancy import Tenancy
from plexrl.policy.profile import JobProfile

PACKING_PAYS = 1.0 / 3.0  # the most sharing may slow a job and still pay, for jobs that end (module docstring)


class Judgement:
    """Judges placements among the jobs of `tenancy`. `pack_limit`: the largest slack a job is
    judged by when it and every job it would share devices with end (None: its own slack).
    `pooled`: a group's devices run any of its jobs' calls (`cotenancy.pooled_inflation`)."""

    def __init__(self, tenancy: Tenancy, pack_limit: float | None, pooled: bool):
        self.tenancy, self.view, self.horizon = tenancy, tenancy.view, tenancy.horizon
        self.pack_limit = pack_limit
        self.pooled = pooled
        # the call model's answers by set of profiles (`wait_inflation`'s memo): a function of
        # the profiles alone, so it is never invalidated, only emptied when full
        self.memo: dict = {}

    def limit(self, profile: JobProfile, others_end: bool) -> float:
        """The slowdown `profile`'s job is judged by in a placement: its slack, at most
        `pack_limit` when it ends and so do the jobs it would share with (`others_end`)."""
        if self.pack_limit is None or not (profile.ends and others_end) or profile.slack <= self.pack_limit:
            return profile.slack
        return self.pack_limit

    def judge(self, profile: JobProfile, best: Candidate, shift: int, share: np.ndarray,
              align_s: float = 0.0) -> Placement | Wait:
        """`best` (the search's candidate, at `shift` slots with the job's `share` there) as a
        Placement, or the Wait that names whom it would slow beyond what."""
        h = self.horizon
        rows = list(best.rows)
        tenants = self.tenants(rows) if profile.barriers > 0 else {}  # only the call model reads them
        calls = knows_calls(profile, tenants)
        if calls:
            inflation = self.call_inflation(profile, tenants, rows)
        else:
            inflation = max(step_inflation(h.load[r], share, 1.0) for r in rows)
        name = self.view.groups[best.group].name
        where = (f"even the best placement (group {name!r}, phase shift {shift * h.slot_s:g} s) projects "
                 f"{best.score:.1f} device-s of overload over the horizon")
        limit = self.limit(profile, self.tenancy.tenants_end(rows))
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

    def inflation_of(self, job: str) -> float:
        """The step inflation the model predicts now for placed `job` with the co-tenants it
        has; 0.0 for a job alone on its devices."""
        placed = self.tenancy.placed[job]
        rows = [self.view.device_rows[d] for d in placed.placement.devices]
        tenants = self.tenants(rows, exclude=job) if placed.profile.barriers > 0 else {}
        if knows_calls(placed.profile, tenants):
            return round(self.call_inflation(placed.profile, tenants, rows), 9)
        h = self.horizon
        in_time = h.columns(h.origin, h.slots)
        mine = h.project(placed.profile, placed.anchor_s, h.origin, h.slots) / len(rows)
        load = h.load[rows][:, in_time]
        return round(max(step_inflation(row - mine, mine, 1.0) for row in load), 9)

    def tenants(self, rows: list[int], exclude: str | None = None) -> dict[str, tuple[JobProfile, float]]:
        """`Tenancy.tenants` of `rows`, over their whole groups when `pooled`."""
        return self.tenancy.tenants(rows, exclude, self.pooled)

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
                limit = self.limit(profile, newcomer.ends)
                if slowed > max(limit, was) + TINY:
                    return job, slowed, limit
        return None

    def _hurt_by_waits(self, newcomer: JobProfile, rows: list[int],
                       tenants: dict[str, tuple[JobProfile, float]]) -> tuple[str, float, float] | None:
        """`_hurt_tenant` under the call model: each tenant's inflation with the newcomer's
        calls added on the devices they share, on top of what the tenant was measured at
        (`Placer.observe`) or else predicted to have."""
        mine = set(rows)
        for job, (profile, _) in tenants.items():
            own = self.tenancy.rows_of(self.tenancy.placed[job])
            slowed = self.pushed(newcomer, job, len(mine.intersection(own)) / len(own))
            if slowed is not None:
                return job, slowed, self.limit(profile, newcomer.ends)
        return None

    def pushed(self, newcomer: JobProfile, job: str, shared: float) -> float | None:
        """Placed `job`'s inflation with the newcomer's calls on `shared` of its devices, on top
        of what it was measured at (`Placer.observe`) or else predicted to have, when that pushes
        it past its slack (or further past it); None when it does not."""
        profile = self.tenancy.placed[job].profile
        others, before = self.cotenants(job)
        with_newcomer = {**others, newcomer.job: (newcomer, shared)}
        added = self.call_inflation(profile, with_newcomer, self.tenancy.rows_of(self.tenancy.placed[job])) - before
        was = self.tenancy.measured.get(job, before)
        return was + added if was + added > max(self.limit(profile, newcomer.ends), was) + TINY else None

    def cotenants(self, job: str) -> tuple[dict[str, tuple[JobProfile, float]], float]:
        """(`tenants` of placed `job`'s devices, the inflation they give it under the call model),
        derived from the placements (`Tenancy.derived`)."""
        kept = self.tenancy.derived.cotenants
        if job not in kept:
            placed = self.tenancy.placed[job]
            rows = self.tenancy.rows_of(placed)
            others = self.tenants(rows, exclude=job)
            kept[job] = others, self.call_inflation(placed.profile, others, rows)
        return kept[job]

    def call_inflation(self, profile: JobProfile, tenants: dict[str, tuple[JobProfile, float]],
                       rows: list[int]) -> float:
        """The call model's inflation of `profile`'s job on `rows` among `tenants` (`tenants`):
        `pooled_inflation` over the devices of its group when `pooled`, else `wait_inflation`."""
        if self.pooled:
            devices = int(self.view.capacity[int(self.tenancy.row_group[rows[0]])])
            return pooled_inflation(profile, [t for t, _ in tenants.values()], devices)
        return wait_inflation(profile, tenants.values(), self.memo)
