"""Refusing without a search: a bound that tells, from the placed jobs' call moments alone,
that the judgement (`judgement.py`) would refuse every devices the search could choose.

Most retries of a saturated cluster's queue end here, at a fraction of a search's cost. The
bound holds under the call model only (every job involved knows its calls, devices pinned):
- the newcomer's own inflation: with fewer than `devices` rows whose tenants could each take
  turns with it (`cotenancy.interleave`, its busy-share sum with a margin: a set interleaves
  only if each subset does), no candidate interleaves, so its inflation is the wait of
  `wait_inflation` over every tenant of its rows, at least what the tenants of the
  `devices`-th least-waiting row alone make (each tenant's wait at least
  `cotenancy.least_wait`); a bound above the slack it is judged by (by a margin) refuses them
  all (`Judgement.limit`; while an open-ended job is placed, its own slack: no less than
  anywhere);
- a row is barred when a tenant on it would be pushed past its slack by sharing even one of
  its devices with the newcomer (`Judgement.pushed` at the least share; what it adds does not
  shrink with the share); the unbarred rows are bounded as above.
Rows on nodes without host room for a replica are never chosen, so they are skipped.

Invariant (tests/test_placement_fastpaths.py): exact. Whenever it answers Wait the search and
judgement refuse too, and every decision equals that of a placer that always searches.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from plexrl.policy.placement.cotenancy import interleave, least_wait
from plexrl.policy.placement.decisions import Wait
from plexrl.policy.placement.judgement import Judgement
from plexrl.policy.profile import JobProfile

Cell = tuple[float, bool]  # a row's (least wait per step for its tenants, whether they may take turns)


class RefusalBound:
    """The bound over the jobs `judgement` judges among."""

    def __init__(self, judgement: Judgement):
        self.judgement, self.tenancy, self.view = judgement, judgement.tenancy, judgement.view

    def refused_everywhere(self, profile: JobProfile, groups: np.ndarray) -> Wait | None:
        """Wait, without a search, when the judgement would refuse every devices of `groups`
        the search could choose, whichever wins; None when some might pass (then the search
        decides). See the module docstring."""
        placed = self.tenancy.placed
        if profile.barriers <= 0 or not placed or self.judgement.pooled:  # the bound is of pinned devices
            return None
        if any(p.profile.barriers <= 0 for p in placed.values()):
            return None
        limit = self.judgement.limit(profile, self.tenancy.open_ended == 0)  # at least what judging allows anywhere
        barred: dict[str, bool] = {}
        cells: dict[tuple[str, ...], Cell] = {}  # a row's jobs -> its cell
        hurt_by: dict[tuple[str, ...], str | None] = {}  # a row's jobs -> the first of them it would push too far
        units = self.view.units_per_node(profile)
        least = math.inf  # the least bound of groups refused for the newcomer's own inflation
        hurts = mixed = False  # some group refused for a co-tenant's sake; for one reason or the other
        visited = []
        for g in groups:
            runs = self._group_runs(profile, int(g), units, cells)
            visited.append(runs)
            bound = self._own_bound(profile, [cells[names] for names, rows in runs for _ in range(rows)])
            if bound > limit + 1e-9:  # refused for its own inflation, whoever would be barred
                least = min(least, bound)
                continue
            unbarred = [cells[names] for names, rows in runs if self._hurt(profile, names, hurt_by, barred) is None
                        for _ in range(rows)]
            if self._own_bound(profile, unbarred) <= limit + 1e-9:
                return None
            elif len(unbarred) < profile.devices:
                hurts = True
            else:
                mixed = True
        tenant = ""  # named only for a co-tenant's sake: the first barring job, in the order of the groups
        if hurts or mixed:
            tenant = next((job for runs in visited for names, _ in runs
                           if (job := self._hurt(profile, names, hurt_by, barred)) is not None), "")
        return self._refusal(profile, limit, least, tenant, hurts, mixed)

    def no_place_beside_itself(self, profile: JobProfile) -> bool:
        """Whether placed `profile`'s job would wait wherever it went, its own devices taken
        (by a copy of it, for the bound; a newcomer there would be judged alike): the bound
        of `refused_everywhere`, a fraction of a try's cost."""
        twin = replace(profile, job=f"{profile.job}\0twin")
        groups = self.view.feasible_groups(twin)
        return len(groups) == 0 or self.refused_everywhere(twin, groups) is not None

    def _group_runs(self, profile: JobProfile, g: int, units: np.ndarray,
                    cells: dict[tuple[str, ...], Cell]) -> list[tuple[tuple[str, ...], int]]:
        """(the jobs of a row, how many rows carry them) for the usable rows of group `g`, with
        each distinct row's cell in `cells`, kept across the groups of one decision (rows with
        the same jobs wait alike and are barred alike)."""
        first = int(self.view.group_first_node[g])
        runs = []
        for node in range(first, first + len(self.view.groups[g].nodes)):
            if units[node] <= 0:
                continue
            for names, rows in self.tenancy.tenancies(node):
                if names not in cells:
                    tenants = [self.tenancy.placed[j].profile for j in names]
                    cells[names] = (sum(least_wait(profile, t) for t in tenants),
                                    interleave(profile, tenants, margin=1e-9))
                runs.append((names, rows))
        return runs

    def _hurt(self, profile: JobProfile, names: tuple[str, ...], hurt_by: dict[tuple[str, ...], str | None],
              barred: dict[str, bool]) -> str | None:
        """The first of a row's jobs `names` that bars the row (`_bars`), asked only where the
        answer matters (a group not refused for the newcomer's own inflation, or the name of
        a refusal), memoised in `hurt_by` for one decision."""
        if names not in hurt_by:
            hurt_by[names] = next((j for j in names if self._bars(profile, j, barred)), None)
        return hurt_by[names]

    @staticmethod
    def _refusal(profile: JobProfile, limit: float, least: float, tenant: str, hurts: bool, mixed: bool) -> Wait:
        """The Wait of a refusal: for the newcomer's own inflation, a co-tenant's, or either."""
        where = "on any devices where its memory fits"
        if not (hurts or mixed):
            return Wait(f"job {profile.job!r} would be slowed by {least:.0%} or more, beyond its slack of "
                        f"{limit:.0%}, {where}")
        if not (mixed or least < math.inf):
            return Wait(f"job {profile.job!r} would slow job {tenant!r} or another co-tenant beyond its slack {where}")
        return Wait(f"job {profile.job!r} would be slowed beyond its slack of {limit:.0%} or slow a "
                    f"co-tenant beyond theirs (e.g. job {tenant!r}) {where}")

    @staticmethod
    def _own_bound(profile: JobProfile, rows: list[Cell]) -> float:
        """A lower bound of the newcomer's inflation on any `devices` of `rows`: 0 when enough
        may take turns with it, +inf when there are too few rows."""
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
        devices (`Judgement.pushed` at the least share), memoised in `memo` for one decision."""
        if job not in memo:
            shared = 1 / len(self.tenancy.placed[job].placement.devices)
            memo[job] = self.judgement.pushed(newcomer, job, shared) is not None
        return memo[job]
