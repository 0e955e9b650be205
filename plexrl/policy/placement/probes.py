"""Lower bounds of group scores from a few probe columns, so that the device search
(`search.py`) scores only groups that might win.

A probe column is a hot column of the horizon (one where the job's peak share could overload
some row) sampled across it; a warm row is one with a hot cell. On the probes of a group's
warm rows, each device's overload bounds its cost from below, and a group with fewer than
`devices` devices free of overload there at a shift must score above 0 at it.

Invariant (tests/test_placement*.py): pruning is exact. A group these bounds rule out scores
no better than the best found (`lower_bounds` never exceeds a group's best score;
`may_score_zero` is False only where every shift scores above 0), so the search's answer is
the one scoring every group would give.
"""

from __future__ import annotations

import math

import numpy as np

from plexrl.policy.horizon import Horizon
from plexrl.policy.placement.cotenancy import TINY
from plexrl.policy.profile import JobProfile
from plexrl.policy.resources import ResourceView

_PROBES = 48  # hot columns sampled across the horizon for the cheap lower bound of a score
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # spreads probes over every period (`_evenly_and_scattered`)
_HEAD_PROBES = 12  # probes every (shift, row) pair is tested on before the rest (`_fits_on_probes`)


class ProbeBounds:
    """Bounds of the scores of `view`'s groups against `horizon`'s load."""

    def __init__(self, view: ResourceView, horizon: Horizon):
        self.view, self.horizon = view, horizon
        self._maxima: tuple[int, np.ndarray] = (-1, np.zeros(0))  # (horizon version, column maxima per group)
        self._known = np.zeros(0, dtype=bool)  # groups whose maxima hold for that version

    def column_maxima(self, groups: list[int]) -> np.ndarray:
        """[i, c]: the largest load on the rows of groups[i] in column c, each group's reduced
        again only when its rows changed (`Horizon.changed_since`; every group once time moves
        on): the decisions asked at one time (a queue retried on a release, a move tried and
        undone) probe the same groups."""
        h = self.horizon
        seen = self._maxima[0]
        if seen != h.version:
            changed = h.changed_since(seen) if seen >= 0 else None
            if changed is None:
                self._maxima = (h.version, np.zeros((len(self.view.group_rows), h.slots)))
                self._known = np.zeros(len(self.view.group_rows), dtype=bool)
            else:
                self._maxima = (h.version, self._maxima[1])
                self._known[self.view.row_group[changed]] = False
        maxima = self._maxima[1]
        missing = [g for g in groups if not self._known[g]]
        if missing:
            sizes = {b - a for a, b in self.view.group_rows}
            if len(sizes) == 1:  # groups of one size: a view of the load by group
                maxima[missing] = h.load.reshape(len(maxima), sizes.pop(), -1)[missing].max(axis=1)
            else:
                maxima[missing] = [h.load[slice(*self.view.group_rows[g])].max(axis=0) for g in missing]
            self._known[missing] = True
        return maxima[groups]

    def may_score_zero(self, groups: list[int], share: np.ndarray, profile: JobProfile,
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

    def lower_bounds(self, groups: list[int], share: np.ndarray, profile: JobProfile,
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
        load, peak, threshold = self.horizon.load, share.max(), 1.0 + TINY
        # a column is hot on some row iff on the row with its largest load (adding is monotone);
        # a cool row's cells are all at most its largest, which cannot overload, so the largest
        # over all the groups' rows (slice by slice, nothing gathered) is hot exactly where the
        # largest over the warm rows is
        top = self.column_maxima(groups).max(axis=0)
        cols = pick(np.flatnonzero(top + peak > threshold))
        at = load[np.ix_(rows[warm], cols)]
        return spans, warm, np.where(at + peak > threshold, 1.0 - at, np.inf), cols


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
