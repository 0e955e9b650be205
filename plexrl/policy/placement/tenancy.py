"""Who is placed where: the placer's record of its jobs on the resource view (memory
committed) and the horizon (projected load per device), and what is derived from it.

Load is projected per device, not per group: a job runs on its own devices only, so two jobs
whose busy phases collide slow each other down exactly when they share devices, however idle
the rest of their group is. A job on n devices puts 1/n of its demand on each (the horizon's
rows are devices, capacity 1.0 each).

Invariants (tests/test_placement*.py):
- `hold` and `release` are the only changes of what is placed; each ends in `_changed`, the
  one point where what is derived from the placed jobs (`Derived`: co-tenants, the jobs per
  node row, unused devices per group) is dropped: what the changed job's node groups touch (the
  tenancies of their nodes, the co-tenants of every job on them, pooled or not), the rest kept
  in a new `Derived` (an undone move's `rewind` restores the old one whole). Nothing else
  invalidates it, and a derived answer is the same whether kept or recomputed.
- A row that no job holds carries exactly 0.0 in every column (the horizon adds to a row only
  for a job on it and rebuilds a row from zeros on remove): `row_jobs[r] == 0` means empty.
- `releases` counts releases only (placing adds load, so only a release can give a refused
  move more room); a tentative move that is undone rewinds it with the derived caches
  (`mark`, `rewind`), as if it had never happened.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from plexrl.policy.horizon import Horizon
from plexrl.policy.placement.decisions import Placement
from plexrl.policy.profile import JobProfile
from plexrl.policy.resources import ResourceView


@dataclass(frozen=True)
class Placed:
    """A placed job: its profile, its placement, and when its first step starts."""

    profile: JobProfile
    placement: Placement
    anchor_s: float


@dataclass
class Derived:
    """What is computed from the placed jobs alone, kept until they change (`Tenancy._changed`):
    a queue retried on one release asks about the same jobs and nodes for every waiting job."""

    # placed job -> (its co-tenants, the inflation they give it under the call model)
    cotenants: dict[str, tuple[dict[str, tuple[JobProfile, float]], float]] = field(default_factory=dict)
    node_tenancy: dict[int, list[tuple[tuple[str, ...], int]]] = field(default_factory=dict)  # `tenancies`
    unused: np.ndarray | None = None  # devices nobody uses, per group


@dataclass(frozen=True)
class Mark:
    """The tenancy's history counters as they were (`Tenancy.mark`), to rewind an undone move."""

    releases: int
    derived: Derived


class Tenancy:
    """The placed jobs on `view` and `horizon`: who holds which rows, measured inflations, and
    the caches derived from them (see the module docstring)."""

    def __init__(self, view: ResourceView, horizon: Horizon):
        self.view, self.horizon = view, horizon
        self.placed: dict[str, Placed] = {}
        self.measured: dict[str, float] = {}  # job -> its latest measured step inflation (`Placer.observe`)
        self.open_ended = 0  # placed jobs whose run has no known end (`JobProfile.ends` False)
        self.calls_unknown = 0  # placed jobs whose profile does not know its calls (`JobProfile.barriers` 0)
        self.row_jobs = np.zeros(len(view.row_device), dtype=np.int64)  # jobs with a share on each row
        self.job_rows: dict[str, np.ndarray] = {}  # placed job -> its device rows
        self.releases = 0
        self.derived = Derived()
        self.node_first_row = np.array([a for a, _ in view.node_rows], dtype=np.int64)
        self.group_bounds = np.array(view.group_rows, dtype=np.int64).reshape(-1, 2)  # (first, end) row
        self.row_group, self.row_node = view.row_group, view.row_node

    def hold(self, placed: Placed) -> None:
        job, p = placed.profile.job, placed.placement
        self.view.allocate(job, p.devices, placed.profile.host_bytes_per_device, placed.profile.shared_host_bytes)
        rows = self.rows_of(placed)
        self.horizon.add(job, rows, placed.profile, placed.anchor_s)
        self.job_rows[job] = np.array(rows, dtype=np.int64)
        self.row_jobs[rows] += 1
        self.placed[job] = placed
        self.open_ended += not placed.profile.ends
        self.calls_unknown += placed.profile.barriers <= 0
        self._changed(job, self.job_rows[job])

    def release(self, job: str) -> None:
        self.measured.pop(job, None)
        placed = self.placed.pop(job, None)
        if placed is not None:
            self.view.free(job)
            self.horizon.remove(job)
            self.open_ended -= not placed.profile.ends
            self.calls_unknown -= placed.profile.barriers <= 0
            rows = self.job_rows.pop(job)
            self.row_jobs[rows] -= 1
            self.releases += 1
            self._changed(job, rows)

    def _changed(self, job: str, rows: np.ndarray) -> None:
        """`job` came onto or left `rows`: the derived answers its node groups touch are dropped
        (the one invalidation point; see the module docstring)."""
        old = self.derived
        nodes = set(self.row_node[rows].tolist())
        touched = {job}
        for g in set(self.row_group[rows].tolist()):
            for row in range(*self.group_bounds[g]):
                touched.update(self.horizon.names_on(row))
        self.derived = Derived(
            cotenants={j: kept for j, kept in old.cotenants.items() if j not in touched},
            node_tenancy={n: kept for n, kept in old.node_tenancy.items() if n not in nodes})

    def mark(self) -> Mark:
        return Mark(self.releases, self.derived)

    def rewind(self, mark: Mark) -> None:
        """An undone move's placements are back as at `mark`: so are its counters and caches."""
        self.releases, self.derived = mark.releases, mark.derived

    def rows_of(self, placed: Placed) -> list[int]:
        return [self.view.device_rows[d] for d in placed.placement.devices]

    def shares_a_device(self, job: str) -> bool:
        rows = self.job_rows[job]
        return bool((self.row_jobs[rows] > 1).any())

    def tenants(self, rows: list[int], exclude: str | None = None,
                pooled: bool = False) -> dict[str, tuple[JobProfile, float]]:
        """Jobs with a share on `rows`: (profile, fraction of `rows` they share), in arrival order.
        `pooled`: every job on the groups of `rows` (their calls run on any of its devices)."""
        if pooled:
            groups = sorted({int(g) for g in self.row_group[rows]})
            rows = [r for g in groups for r in range(*self.view.group_rows[g])]
        found: dict[str, list] = {}
        for row in rows:
            for job in self.horizon.names_on(row):  # the horizon holds each with its placed profile
                if job != exclude:
                    entry = found.get(job)
                    if entry is None:
                        found[job] = [self.placed[job].profile, 1]
                    else:
                        entry[1] += 1
        return {job: (profile, n / len(rows)) for job, (profile, n) in found.items()}

    def tenants_end(self, rows: list[int]) -> bool:
        """Whether every job placed on `rows` ends (at once when every placed job does)."""
        return self.open_ended == 0 or all(self.placed[j].profile.ends for r in rows for j in self.horizon.names_on(r))

    def tenancies(self, node: int) -> list[tuple[tuple[str, ...], int]]:
        """The distinct sets of jobs on `node`'s rows (`Horizon.names_on`), in the order of
        their first row, with how many rows carry each (derived)."""
        found = self.derived.node_tenancy.get(node)
        if found is None:
            counts: dict[tuple[str, ...], int] = {}
            for row in range(*self.view.node_rows[node]):
                names = self.horizon.names_on(row)
                counts[names] = counts.get(names, 0) + 1
            found = self.derived.node_tenancy[node] = list(counts.items())
        return found

    def unused(self) -> np.ndarray:
        """Devices nobody uses, per group (derived)."""
        if self.derived.unused is None:
            self.derived.unused = np.add.reduceat(self.row_jobs == 0, self.group_bounds[:, 0])
        return self.derived.unused
