"""The judgement of a placement: whether the step inflation it predicts (`cotenancy.py`)
keeps the job and every job it would share devices with within what each is judged by, and
the `Wait` that says why not.

A job waits when the choice would exceed its own slack or push a co-tenant beyond theirs, or
when sharing would cost the jobs involved more than waiting costs it ("Packing by effect",
below). Only the search's best candidate is judged: no second-best search.

Measured inflation feeds back (`Placer.observe`): a tenant whose measured inflation is known is
judged by it plus what the newcomer adds, so a group whose tenants run under their
predictions may take more, and one with a tenant past its slack takes nobody onto its devices.

Packing by effect (ours; the default, `by_effect`). A job's slack is what it tolerates, not
what the placer should fill: sharing devices trades the tenants' speed for the newcomer's start,
so a placement that shares is taken only when that lowers the sum of the completion times of the
jobs involved, weighed per decision from their profiles. Take a newcomer with L seconds of run
left (alone) and tenants k on the devices it would share, with R_k left: sharing at the
newcomer's predicted inflation i, which adds d_k to tenant k's, costs about
    i * L  +  sum_k d_k * R_k
seconds of completion time; waiting for those devices costs the newcomer W = max_k R_k (1 + i_k),
until the last of the tenants, at the inflation it runs at now (i_k), is gone. It shares when W
exceeds the cost, else it waits (and is retried whenever a job ends or moves). With one tenant
of the newcomer's length this is the derivation of the old fixed limit: i * L + i * R < R,
i < R / (L + R), i.e. i < 1/3 = `PACKING_PAYS` for a tenant found at a uniform point of its run
(E[R] = L / 2); here L, R_k, d_k and i_k are the decision's own. The newcomer is charged its
slowdown over its whole run, not only while these tenants stay: on a crowded cluster another job
takes a leaving tenant's place. A run is known when the job declared its steps
(`JobProfile.run_s`: the simulator's jobs; `steps` periods); what is left of it is estimated from
when its first step started (`started`, kept across moves) and its inflation (measured, else
predicted): run - elapsed / (1 + i_k). Out of scope (first order): the jobs queued behind, whose
wait a slowed tenant lengthens and a start shortens. When the newcomer or a tenant did not
declare its run (a service session may hold its model for days) the rule does not apply and the
slack alone decides: nobody waits on a job that never leaves.

The operator's pack limit (an option, `pack_limit`, off by default): a job that ends is judged
by at most `pack_limit` among tenants that end too, in place of its slack when that is larger;
the fixed form of the rule above (`PACKING_PAYS` = 1/3). The runtime takes it as
`ClusterConfig.pack_limit`, the simulator as the workload's `pack_limit` or `--pack-limit X`
(`--pack-limit none`: each job's own slack only, no effect rule).

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

PACKING_PAYS = 1.0 / 3.0  # the fixed pack limit's usual value: sharing pays below it for E[R] = L / 2 (module docstring)


class Judgement:
    """Judges placements among the jobs of `tenancy`. `pack_limit`: the largest slack a job is
    judged by when it and every job it would share devices with end (None: its own slack).
    `pooled`: a group's devices run any of its jobs' calls (`cotenancy.pooled_inflation`).
    `by_effect`: a placement that shares must lower the jobs' summed completion time ("Packing
    by effect"). `now` is the decision's time (set by `Placer` before it judges), `started` when
    each placed job's first step began."""

    def __init__(self, tenancy: Tenancy, pack_limit: float | None, pooled: bool, by_effect: bool = True):
        self.tenancy, self.view, self.horizon = tenancy, tenancy.view, tenancy.horizon
        self.pack_limit = pack_limit
        self.pooled = pooled
        self.by_effect = by_effect
        self.now = 0.0
        self.started: dict[str, float] = {}
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
        effect = self.effect(profile, rows, inflation, share) if self.by_effect else None
        if effect is not None and effect[0] >= effect[1]:
            return Wait(f"job {profile.job!r} sharing devices (slowed by {inflation:.0%}) would cost the jobs "
                        f"involved {effect[0] / 3600:.2f} h of completion time, waiting ~{effect[1] / 3600:.2f} h "
                        f"for devices of its own less: {where}")
        devices = tuple(int(self.view.row_device[r]) for r in rows)
        return Placement(name, shift * h.slot_s + align_s, best.score, devices, inflation)

    # -- packing by effect (module docstring) -------------------------------------------------

    def effect(self, profile: JobProfile, rows: list[int], inflation: float,
               share: np.ndarray) -> tuple[float, float] | None:
        """(seconds of completion time that sharing `rows` at `inflation` costs the newcomer and
        the jobs it would slow, seconds it would wait for those devices instead); None when
        nobody is on `rows` or a run involved is not known (then the slack alone decides)."""
        tenants = self.tenants(rows)
        if not tenants or profile.run_s <= 0 or any(p.run_s <= 0 for p, _ in tenants.values()):
            return None
        added = self.added(profile, rows, share, tenants)
        cost, wait = inflation * self.left_s(profile.job, profile, 0.0), 0.0
        for job, (tenant, _) in tenants.items():
            slowed = self.inflation_now(job)
            left = self.left_s(job, tenant, slowed)
            cost += added[job] * left
            wait = max(wait, left * (1.0 + slowed))
        return cost, wait

    def left_s(self, job: str, profile: JobProfile, inflation: float) -> float:
        """Seconds of its run alone that `job` has left: its run less what it did since its first
        step began (`started`; elapsed over 1 + `inflation`); the whole run before it started."""
        began = self.started.get(job)
        if began is None or began >= self.now:
            return profile.run_s
        return max(profile.run_s - (self.now - began) / (1.0 + inflation), 0.0)

    def inflation_now(self, job: str) -> float:
        """Placed `job`'s inflation: measured (`Placer.observe`), else what the call model predicts
        among its co-tenants (0.0 under the fluid model, or alone)."""
        measured = self.tenancy.measured.get(job)
        if measured is not None:
            return max(measured, 0.0)
        placed = self.tenancy.placed[job]
        if placed.profile.barriers <= 0 or not self.tenancy.shares_a_device(job):
            return 0.0
        others, predicted = self.cotenants(job)
        return predicted if knows_calls(placed.profile, others) else 0.0

    def added(self, newcomer: JobProfile, rows: list[int], share: np.ndarray,
              tenants: dict[str, tuple[JobProfile, float]]) -> dict[str, float]:
        """The inflation the newcomer on `rows` adds to each of `tenants`: the call model's when
        every job involved knows its calls, else the fluid model's (as `_hurt_tenant`)."""
        out = {}
        h = self.horizon
        in_time = h.columns(h.origin, h.slots)
        for job, (profile, _) in tenants.items():
            own = self.tenancy.rows_of(self.tenancy.placed[job])
            others, before = self.cotenants(job) if profile.barriers > 0 else ({}, 0.0)
            if newcomer.barriers > 0 and knows_calls(profile, others):
                shared = len(set(rows).intersection(own)) / len(own)
                after = self.call_inflation(profile, {**others, newcomer.job: (newcomer, shared)}, own)
                out[job] = max(after - before, 0.0)
                continue
            placed = self.tenancy.placed[job]
            mine = h.project(profile, placed.anchor_s, h.origin, h.slots) / len(own)
            was = h.load[own][:, in_time]
            now = was + np.isin(own, rows)[:, None] * share[in_time]
            out[job] = max(max(step_inflation(a - mine, mine, 1.0) for a in now)
                           - max(step_inflation(b - mine, mine, 1.0) for b in was), 0.0)
        return out

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
