"""The cyclic time horizon: projected demand of every device over [t, t+H).

One ring buffer per row, stored as the rows of one (rows, H) array so the placer can score
many rows with a few numpy operations. The placer's rows are devices: a job placed on n
devices puts 1/n of its profile on each of them (its work spreads evenly over its devices), so
a row's load is in busy devices and 1.0 is a full device. Slots have a fixed width `slot_s`;
absolute slot a (covering [a * slot_s, (a + 1) * slot_s)) lives in column a % H while it is in
the window. Moving time forward recomputes only the columns that fell out of the window (they
now hold the slots that entered it), so the buffer never grows: space is H per row, whatever
the number of jobs or how long they run.

A placed job contributes its profile tiled from its anchor (its first step starts at
`anchor_s`, later steps every `period_s`), averaged exactly over each slot. Jobs are assumed to
be in steady state across the window; the runtime re-places a job whose profile drifts.

Invariant (tested): every column equals the sum of the placed jobs' shares of their
projections onto the absolute slot it holds, after any sequence of add, remove and advance.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from plexrl.policy.profile import JobProfile, average_demand


class Horizon:
    def __init__(self, rows: int, slots: int, slot_s: float):
        if rows < 1 or slots < 1:
            raise ValueError(f"a Horizon needs >= 1 row and >= 1 slot, got {rows} and {slots}")
        if not slot_s > 0:
            raise ValueError(f"slot_s must be > 0 seconds, got {slot_s}")
        self.slots, self.slot_s = slots, float(slot_s)
        self.load = np.zeros((rows, slots))
        self.origin = 0  # absolute slot at the start of the window
        self._jobs: dict[str, tuple[tuple[int, ...], JobProfile, float]] = {}  # job -> (rows, profile, anchor)
        self._on_row: dict[int, dict[str, None]] = {}  # row -> its jobs, in the order they came
        self._cumulative: dict[str, np.ndarray] = {}  # job -> its profile's cumulative busy time
        self._table: _JobTable | None = None  # flat copy of _jobs for advance; None when stale
        self._order: dict[str, int] = {}  # job -> when it came (the order of _jobs), for `remove`
        self._added = 0
        self.version = 0  # moves on with every change of `load` (caches of it are keyed by it)
        self.row_version = np.zeros(rows, dtype=np.int64)  # the version at each row's last change by add/remove
        self.advanced_version = 0  # the version at the last change of every row (time moving on)

    def project(self, profile: JobProfile, anchor_s: float, first_slot: int, n: int) -> np.ndarray:
        """Mean busy devices of `profile` anchored at `anchor_s` over absolute slots
        [first_slot, first_slot + n)."""
        edges = (first_slot + np.arange(n + 1)) * self.slot_s - anchor_s
        return average_demand(profile, edges)

    def columns(self, first_slot: int, n: int) -> np.ndarray:
        return (first_slot + np.arange(n)) % self.slots

    def positions(self) -> np.ndarray:
        """For each column, its offset from the window start (0 = the slot holding now)."""
        return (np.arange(self.slots) - self.origin) % self.slots

    def advance(self, now: float) -> None:
        """Move the window to start at the slot holding `now`."""
        start = math.floor(now / self.slot_s)
        if start < self.origin:
            raise ValueError(
                f"time went backwards: now={now} s is before the horizon start "
                f"{self.origin * self.slot_s} s"
            )
        entered = min(start - self.origin, self.slots)
        self.origin = start
        if entered:
            self.version += 1
            self.advanced_version = self.version
            self._recompute(first_slot=start + self.slots - entered, n=entered)

    def changed_since(self, version: int) -> np.ndarray | None:
        """The rows whose load changed after `version` (a value of `self.version`), or None when
        every row may have (time moved on since): what a cache of per-row figures recomputes."""
        if self.advanced_version > version:
            return None
        return np.flatnonzero(self.row_version > version)

    def add(self, job: str, rows: int | Sequence[int], profile: JobProfile, anchor_s: float) -> None:
        """Project `job` onto `rows` (one row, or the job's devices: each gets an equal share)."""
        if job in self._jobs:
            raise ValueError(f"job {job!r} is already on the horizon")
        rows = (rows,) if isinstance(rows, (int, np.integer)) else tuple(int(r) for r in rows)
        if not rows or len(set(rows)) != len(rows):
            raise ValueError(f"job {job!r}: rows must be distinct and non-empty, got {rows}")
        self._jobs[job] = (rows, profile, anchor_s)
        self.version += 1
        self._order[job] = self._added = self._added + 1
        for row in rows:
            self._on_row.setdefault(row, {})[job] = None
        self._cumulative[job] = profile.cumulative()
        self._table = None
        self.row_version[list(rows)] = self.version
        cols = self.columns(self.origin, self.slots)
        share = self.project(profile, anchor_s, self.origin, self.slots) / len(rows)
        for row in rows:
            self.load[row, cols] += share

    def remove(self, job: str) -> None:
        """Take `job` off; its rows are rebuilt from the remaining jobs (no subtraction residue)."""
        rows, _, _ = self._jobs.pop(job)
        del self._order[job]
        self.version += 1
        for row in rows:
            del self._on_row[row][job]
        del self._cumulative[job]
        self._table = None
        self.row_version[list(rows)] = self.version
        self.load[list(rows)] = 0.0
        cols, mine = self.columns(self.origin, self.slots), set(rows)
        # only the jobs on its rows, in the order they came: each row sums its jobs as before
        others = {other for row in rows for other in self._on_row[row]}
        for other in sorted(others, key=self._order.__getitem__):
            other_rows, profile, anchor = self._jobs[other]
            share = self.project(profile, anchor, self.origin, self.slots) / len(other_rows)
            for row in other_rows:
                if row in mine:
                    self.load[row, cols] += share

    def jobs_on(self, row: int) -> list[tuple[str, JobProfile, float, tuple[int, ...]]]:
        """(job, profile, anchor, rows) of every job with a share on `row`, in the order they came."""
        return [(job, *self._jobs[job][1:], self._jobs[job][0]) for job in self.names_on(row)]

    def names_on(self, row: int) -> tuple[str, ...]:
        """The jobs with a share on `row`, in the order they came."""
        return tuple(self._on_row.get(row, ()))

    def window(self, row: int) -> np.ndarray:
        """One group's load in time order, from the slot holding now."""
        return np.roll(self.load[row], -(self.origin % self.slots))

    def overload_s(self, capacity: np.ndarray) -> np.ndarray:
        """Device-seconds of projected overload per row: sum of max(0, load - capacity) * slot."""
        return np.maximum(self.load - np.asarray(capacity)[:, None], 0.0).sum(axis=1) * self.slot_s

    def _recompute(self, first_slot: int, n: int) -> None:
        cols = self.columns(first_slot, n)
        if not self._jobs:
            self.load[:, cols] = 0.0
            return
        # each cell: 0.0 plus its entries' values in entry order, as np.add.at adds them (bincount
        # accumulates in input order too), at a fraction of its cost
        rows, values = self._project_all(first_slot, n)
        cells = (rows[:, None] * n + np.arange(n)[None, :]).ravel()
        self.load[:, cols] = np.bincount(cells, values.ravel(), minlength=len(self.load) * n).reshape(-1, n)

    def _project_all(self, first_slot: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """`project` for every placed job at once: (rows, values of shape (jobs, n)).

        All jobs' cumulative-busy tables are laid side by side on one axis (job j's step maps
        onto [2j, 2j + 1]) so a single np.interp serves them all; time moves every slot, so
        this is the hot path of `advance`.
        """
        if self._table is None:
            self._table = _JobTable(list(self._jobs.values()), list(self._cumulative.values()))
        t = self._table
        edges = (first_slot + np.arange(n + 1))[None, :] * self.slot_s - t.anchor[:, None]
        steps, within = np.divmod(edges, t.period[:, None])
        x = t.offset[:, None] + within / t.period[:, None]
        busy = steps * t.per_step[:, None] + np.interp(x, t.xs, t.ys)
        per_job = np.diff(busy, axis=1) / self.slot_s
        return t.rows, per_job[t.entry_job] * t.entry_share[:, None]


class _JobTable:
    """The placed jobs' profiles as flat arrays (see `Horizon._project_all`); one entry per
    (job, row) pair carries the row and the job's share."""

    def __init__(self, jobs: list[tuple[tuple[int, ...], JobProfile, float]], cumulative: list[np.ndarray]):
        self.rows = np.array([row for rows, _, _ in jobs for row in rows], dtype=np.int64)
        self.entry_job = np.repeat(np.arange(len(jobs)), [len(rows) for rows, _, _ in jobs])
        self.entry_share = np.concatenate([np.full(len(rows), 1.0 / len(rows)) for rows, _, _ in jobs])
        self.anchor = np.array([anchor for _, _, anchor in jobs])
        self.period = np.array([p.period_s for _, p, _ in jobs])
        self.offset = 2.0 * np.arange(len(jobs))
        sizes = np.array([len(c) for c in cumulative])
        self.per_step = np.array([c[-1] for c in cumulative])
        # job j's slot edges: 2j + i / (n_j - 1) for i = 0 .. n_j - 1
        within = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        self.xs = np.repeat(self.offset, sizes) + within / np.repeat(sizes - 1, sizes)
        self.ys = np.concatenate(cumulative)
