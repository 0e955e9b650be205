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
- where enough rows may take turns with it, the bound reads who their tenants are instead
  (`_by_tenants`): beside one tenant alone its inflation is the pair's, exactly; beside two or
  more that take turns with it, it is held to the slowest period; beside two or more that do
  not, it waits for each. A job of a 600 s step beside tenants of 600-1,300 s steps is slowed
  13% or more wherever it goes, which the turns alone would have let through to a search;
- a row is barred when a tenant on it would be pushed past its slack by sharing even one of
  its devices with the newcomer (`Judgement.pushed` at the least share; what it adds does not
  shrink with the share); the unbarred rows are bounded as above;
- packing by effect (`Judgement.effect`, when every run involved is known): on unbarred rows
  where the newcomer's inflation is at least b > 0, sharing costs at least b times what is left
  of its run, and waiting for the devices at most the longest wait among the rows' jobs; where
  the first is already the larger, every choice there is refused (`_costs_more`).
Rows on nodes without host room for a replica are never chosen, so they are skipped.

Invariant (tests/test_placement_fastpaths.py): exact. Whenever it answers Wait the search and
judgement refuse too, and every decision equals that of a placer that always searches (the
Wait's words may differ: the bound's, not the judged candidate's). `no_place_beside_itself`
(which moves are tried) keeps the rows' turns alone: it bounds a state that is not the one the
move would judge, so a tighter answer there would change which moves are tried.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from plexrl.policy.placement.cotenancy import busy_s, interleave, least_wait, wait_inflation
from plexrl.policy.placement.decisions import Wait
from plexrl.policy.placement.judgement import Judgement
from plexrl.policy.profile import JobProfile

Cell = tuple[float, bool]  # a row's (least wait per step for its tenants, whether they may take turns)
_CELL_ENTRIES = 1 << 16  # the cells kept across decisions are dropped when this many are kept


class RefusalBound:
    """The bound over the jobs `judgement` judges among."""

    def __init__(self, judgement: Judgement):
        self.judgement, self.tenancy, self.view = judgement, judgement.tenancy, judgement.view
        self._cells: dict[tuple[int, ...], tuple] = {}  # (newcomer, tenants) ids -> (their profiles, cell)

    def refused_everywhere(self, profile: JobProfile, groups: np.ndarray, by_tenants: bool = True) -> Wait | None:
        """Wait, without a search, when the judgement would refuse every devices of `groups`
        the search could choose, whichever wins; None when some might pass (then the search
        decides). `by_tenants`: the newcomer's bound reads who the rows' tenants are
        (`_by_tenants`), not only whether each row's may take turns with it, and packing by
        effect is bounded too (`_costs_more`); without it, the rows' cells alone (as
        `no_place_beside_itself` asks). See the module docstring."""
        placed = self.tenancy.placed
        if profile.barriers <= 0 or not placed or self.judgement.pooled:  # the bound is of pinned devices
            return None
        if self.tenancy.calls_unknown:
            return None
        limit = self.judgement.limit(profile, self.tenancy.open_ended == 0)  # at least what judging allows anywhere
        barred: dict[str, bool] = {}
        cells: dict[tuple[str, ...], Cell] = {}  # a row's jobs -> its cell
        hurt_by: dict[tuple[str, ...], str | None] = {}  # a row's jobs -> the first of them it would push too far
        units = self.view.units_per_node(profile)
        least = math.inf  # the least bound of groups refused for the newcomer's own inflation
        hurts = mixed = False  # some group refused for a co-tenant's sake; for one reason or the other
        visited = []
        facts = _TenantFacts(profile, placed) if by_tenants else None
        for g in groups:
            runs = self._group_runs(profile, int(g), units, cells)
            visited.append(runs)
            bound = self._bound(profile, runs, cells, facts, limit)
            if bound > limit + 1e-9:  # refused for its own inflation, whoever would be barred
                least = min(least, bound)
                continue
            unbarred = [(names, rows) for names, rows in runs if self._hurt(profile, names, hurt_by, barred) is None]
            bound = self._bound(profile, unbarred, cells, facts, limit)
            if bound <= limit + 1e-9 and not (by_tenants and self._costs_more(profile, unbarred, bound)):
                return None
            elif sum(rows for _, rows in unbarred) < profile.devices:
                hurts = True
            else:
                mixed = True
        tenant = ""  # named only for a co-tenant's sake: the first barring job, in the order of the groups
        if hurts or mixed:
            tenant = next((job for runs in visited for names, _ in runs
                           if (job := self._hurt(profile, names, hurt_by, barred)) is not None), "")
        return self._refusal(profile, limit, least, tenant, hurts, mixed)

    def _costs_more(self, profile: JobProfile, runs: list[tuple[tuple[str, ...], int]], bound: float) -> bool:
        """Whether packing by effect (`Judgement.effect`) refuses any devices of the rows `runs`,
        where the newcomer's inflation is at least `bound` > 0 (so every such devices carry a
        job): sharing costs at least `bound` times what is left of its run, and waiting for the
        devices costs at most the longest wait among the rows' jobs (`Judgement.effect` takes
        the longest among the chosen devices' jobs). Only when every run involved is known."""
        j = self.judgement
        if not j.by_effect or bound <= 1e-9 or profile.run_s <= 0:
            return False
        jobs = {job for names, _ in runs for job in names}
        if any(self.tenancy.placed[job].profile.run_s <= 0 for job in jobs):
            return False
        wait = 0.0
        for job in jobs:
            slowed = j.inflation_now(job)
            wait = max(wait, j.left_s(job, self.tenancy.placed[job].profile, slowed) * (1.0 + slowed))
        return (bound - 1e-9) * j.left_s(profile.job, profile, 0.0) >= wait

    def no_place_beside_itself(self, profile: JobProfile) -> bool:
        """Whether placed `profile`'s job would wait wherever it went, its own devices taken
        (by a copy of it, for the bound; a newcomer there would be judged alike): the bound
        of `refused_everywhere`, a fraction of a try's cost."""
        twin = replace(profile, job=f"{profile.job}\0twin")
        groups = self.view.feasible_groups(twin)
        # the rows' cells only: this answer decides which moves are tried, and with a copy of
        # the job in place of whoever would take its devices it is not exact anyway
        return len(groups) == 0 or self.refused_everywhere(twin, groups, by_tenants=False) is not None

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
                    cells[names] = self._cell(profile, names)
                runs.append((names, rows))
        return runs

    def _cell(self, profile: JobProfile, names: tuple[str, ...]) -> Cell:
        """The cell of a row carrying the jobs `names` for newcomer `profile`: a function of the
        profiles alone, kept across decisions by their identities (a waiting job retried, a job
        tried for a move, asks about the same rows again); the entry keeps the profiles alive,
        so no id in its key can be another's while it stands."""
        tenants = [self.tenancy.placed[j].profile for j in names]
        key = (id(profile), *map(id, tenants))
        hit = self._cells.get(key)
        if hit is None:
            if len(self._cells) >= _CELL_ENTRIES:
                self._cells.clear()
            cell = (sum(least_wait(profile, t) for t in tenants), interleave(profile, tenants, margin=1e-9))
            hit = self._cells[key] = (profile, tenants, cell)
        return hit[2]

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
        example = f" (e.g. job {tenant!r})" if tenant else ""
        return Wait(f"job {profile.job!r} would be slowed beyond its slack of {limit:.0%}, slow a co-tenant beyond "
                    f"theirs{example}, or cost the jobs involved more completion time sharing devices than it would "
                    f"waiting for devices of its own, {where}")

    def _bound(self, profile: JobProfile, runs: list[tuple[tuple[str, ...], int]], cells: dict[tuple[str, ...], Cell],
               facts: _TenantFacts | None, limit: float) -> float:
        """A lower bound of the newcomer's inflation on any `devices` of the rows `runs` (a
        row's jobs, how many rows carry them): `_own_bound` from the rows' cells, raised by
        `_by_tenants` where that alone would let it pass."""
        bound = self._own_bound(profile, runs, cells)
        if facts is None or bound > limit + 1e-9:
            return bound
        return max(bound, _by_tenants(profile, runs, cells, facts))

    @staticmethod
    def _own_bound(profile: JobProfile, runs: list[tuple[tuple[str, ...], int]], cells: dict[tuple[str, ...], Cell]
                   ) -> float:
        """A lower bound of the newcomer's inflation on any `devices` of the rows `runs` from
        their cells: 0 when enough may take turns with it, +inf when there are too few rows."""
        need = profile.devices
        if sum(rows for _, rows in runs) < need:
            return math.inf
        if sum(rows for names, rows in runs if cells[names][1]) >= need:
            return 0.0
        # the tenants of any `need` rows include those of each, so they wait at least what
        # the need-th least-waiting row's tenants alone make it wait
        return _nth_least_wait(runs, cells, need) / profile.period_s

    def _bars(self, newcomer: JobProfile, job: str, memo: dict[str, bool]) -> bool:
        """Whether placed `job` would be pushed past its slack by the newcomer on one of its
        devices (`Judgement.pushed` at the least share), memoised in `memo` for one decision."""
        if job not in memo:
            shared = 1 / len(self.tenancy.placed[job].placement.devices)
            memo[job] = self.judgement.pushed(newcomer, job, shared) is not None
        return memo[job]


class _TenantFacts:
    """What `_by_tenants` asks of each placed job as a co-tenant of `newcomer`, computed once
    per decision: the newcomer's exact inflation beside it alone, the newcomer's least wait for
    it (`least_wait`), its busy share and period."""

    def __init__(self, newcomer: JobProfile, placed: dict):
        self.newcomer, self.placed = newcomer, placed
        self._pair: dict[str, float] = {}
        self._least: dict[str, float] = {}

    def pair(self, job: str) -> float:
        if job not in self._pair:
            self._pair[job] = wait_inflation(self.newcomer, [(self.placed[job].profile, 1.0)])
        return self._pair[job]

    def least(self, job: str) -> float:
        if job not in self._least:
            self._least[job] = least_wait(self.newcomer, self.placed[job].profile)
        return self._least[job]

    def busy_share(self, job: str) -> float:
        profile = self.placed[job].profile
        return busy_s(profile) / profile.period_s

    def period_s(self, job: str) -> float:
        return self.placed[job].profile.period_s


def _by_tenants(profile: JobProfile, runs: list[tuple[tuple[str, ...], int]], cells: dict[tuple[str, ...], Cell],
                facts: _TenantFacts) -> float:
    """A lower bound of the newcomer's inflation (`wait_inflation`) on any `devices` of the
    rows `runs`, by the set T of jobs those devices carry:
    - T has at most one job: only rows with no job or with that job alone take part; the
      inflation is the pair's, exactly (0 with no job);
    - T has two jobs or more and they take turns with the newcomer (`interleave`; a set does
      only if its busy shares sum to at most 1): it is held to the slowest period, at least
      the second-shortest among the rows' jobs; they can only when the newcomer's busy share
      and the two least of theirs fit;
    - else it waits for every job of T, at least `least_wait` each: at least the two least,
      and at least what the `devices`-th least-waiting row's jobs alone make it wait (every
      devices include a row waiting that much).
    `_conserving` only raises inflations, so each holds after it. (`_own_bound` reads only
    whether each row's jobs may take turns with the newcomer, so rows that may give it 0.)"""
    need = profile.devices
    empty = sum(rows for names, rows in runs if not names)
    if empty >= need:
        return 0.0
    alone: dict[str, int] = {}
    for names, rows in runs:
        if len(names) == 1:
            alone[names[0]] = alone.get(names[0], 0) + rows
    one = min((facts.pair(job) for job, rows in alone.items() if rows + empty >= need), default=math.inf)
    jobs = sorted({job for names, _ in runs for job in names})
    if len(jobs) < 2:
        return one
    least = sorted(facts.least(job) for job in jobs)
    several = max(least[0] + least[1], _nth_least_wait(runs, cells, need)) / profile.period_s
    shares = sorted(facts.busy_share(job) for job in jobs)
    if busy_s(profile) / profile.period_s + shares[0] + shares[1] <= 1.0 + 1e-9:
        periods = sorted(facts.period_s(job) for job in jobs)
        several = min(several, max(0.0, periods[1] / profile.period_s - 1.0))
    return min(one, several)


def _nth_least_wait(runs: list[tuple[tuple[str, ...], int]], cells: dict[tuple[str, ...], Cell], n: int) -> float:
    """The n-th least of the rows' least waits (each run counted once per row it covers)."""
    counted = 0
    for wait, rows in sorted((cells[names][0], rows) for names, rows in runs):
        counted += rows
        if counted >= n:
            return wait
    return math.inf
