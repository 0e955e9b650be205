"""The device search: for a job, the node group, phase shift and devices where its projected
load collides least with what the placed jobs project (docs/design.md §6).

How a candidate is found:
1. memory: only groups where every model fits a device arena and the job's host buffers fit
   its nodes are searched (`ResourceView.feasible_groups`, one vector pass over the nodes);
2. contention: for each such group, each of its devices d and each candidate phase shift phi
   (multiples of the horizon slot inside one period, at most `max_shifts` of them),
       cost(d, phi) = sum over slots of max(0, load_d + shift(demand, phi) / n - 1) * slot_s,
   the device-time of projected overload if the job used d. Only slots where load_d plus the
   job's peak share exceeds 1 can overload, so only those are evaluated, for all shifts at
   once (a gather from one projection of the job, shifted by index);
3. devices: the group's score at phi is the least total cost of n devices, taken in whole
   replicas per node (`replica_devices`) within each node's host room (`units`: replicas per
   node): per node the cheapest devices first, then the cheapest replicas over the group's
   nodes (the greedy choice is optimal: per node, cost grows with every replica added). Equal
   costs go to the device carrying less projected load (spreading within a group), then the
   lower device;
4. choice: lowest score; ties go to the group already carrying more load (packing keeps empty
   groups for large jobs), then to the earlier group, then to the smaller shift. With a group
   that scores 0 for sure among the candidates, groups are visited in that tie order and the
   first that scores 0 ends the search; otherwise in the order of their lower bounds, so that
   the best is found early and the groups that cannot beat it go unscored (both exact).

Kept between decisions: each row's summed and largest load, and each group's largest load per
column, reduced again only for the rows that changed while time stays in one slot
(`Horizon.changed_since`): a queue retried on a release, or a move tried and undone, asks
about the same rows again.

Invariants (tests/test_placement*.py): every fast path gives the plain computation's numbers
bit for bit (twin rows costed once, reductions over occupied rows only, pruning by probes,
`probes.py`); the search changes nothing; scores are rounded to a micro device-second, so
float residue cannot break ties.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plexrl.policy.placement.cotenancy import TINY
from plexrl.policy.placement.probes import ProbeBounds
from plexrl.policy.placement.tenancy import Tenancy
from plexrl.policy.profile import JobProfile

_CHUNK_CELLS = 1 << 21  # bounds the (shifts x hot cells) scratch array to ~16 MB
_BOUND_BLOCK = 32  # groups bounded per vector pass
_MAX_RUNS = 16  # runs of occupied rows reduced slice by slice; more are gathered first


@dataclass(frozen=True)
class Candidate:
    """The search's answer: a group, a shift (an index into the decision's shifts), its score,
    and the job's device rows."""

    group: int
    shift: int
    score: float
    rows: tuple[int, ...]


class DeviceSearch:
    """Searches the groups of `tenancy`'s view against its horizon. `max_shifts` bounds the
    candidate phase shifts per decision; a period longer than that many slots is searched
    with a coarser stride."""

    def __init__(self, tenancy: Tenancy, max_shifts: int):
        self.tenancy, self.view, self.horizon = tenancy, tenancy.view, tenancy.horizon
        self.max_shifts = max_shifts
        self.probes = ProbeBounds(self.view, self.horizon)
        self._row_stats: tuple[int, np.ndarray, np.ndarray] = (-1, np.zeros(0), np.zeros(0))  # (version, sums, maxima)

    def shift_slots(self, profile: JobProfile) -> np.ndarray:
        distinct = max(1, int(np.ceil(profile.period_s / self.horizon.slot_s - 1e-9)))
        stride = -(-distinct // self.max_shifts)
        return np.arange(0, distinct, stride)

    def shifted_share(self, profile: JobProfile, now: float, shifts: np.ndarray) -> np.ndarray:
        """share[k, c]: the job's demand per device (1/devices of it) started at now + shifts[k]
        slots, in ring column c.

        One projection over [origin - max shift, origin + H) serves every shift: shifting by k
        slots is reading it k slots earlier, gathered straight into ring order.
        """
        h, top = self.horizon, int(shifts[-1])
        extended = h.project(profile, now, h.origin - top, h.slots + top) / profile.devices
        return extended[(top - shifts)[:, None] + h.positions()[None, :]]

    def best(self, groups: np.ndarray, profile: JobProfile, share: np.ndarray, units: np.ndarray) -> Candidate:
        """The best (group, shift, devices) of `groups`: the least score, ties to the group first
        in tie order (most carried load first, then topology order), then the smaller shift.
        `units`: the replicas each node has host room for (`ResourceView.units_per_node`).

        Exact pruning: a group with enough devices free of hot cells scores 0 at every shift
        (`all_cool`); with one among `groups`, the answer is the first group in tie order that
        scores 0, and the groups before the first cool one are tested by the cheaper
        `ProbeBounds.may_score_zero` (`_before_cool`). Without one, every group's lower bound
        (`ProbeBounds.lower_bounds`) is taken first and groups are scored in the order of their
        bounds (`_best_first`), so that a group that cannot beat the best found is skipped.
        """
        row_load, row_max = self.row_sums_and_maxima()
        cool_rows = row_max + share.max() <= 1.0 + TINY  # no cell where the job could overload
        all_cool = self.all_cool(cool_rows, profile, units)
        order, _ = self.tie_order(groups, row_load)
        if all_cool[groups].any():
            zero = self.all_cool(self._may_be_free(row_load, row_max, share) | cool_rows, profile, units)
            return self._before_cool(order, all_cool, zero, profile, share, units, cool_rows)
        return self._best_first(order, profile, share, units, cool_rows)

    def _may_be_free(self, row_load: np.ndarray, row_max: np.ndarray, share: np.ndarray) -> np.ndarray:
        """Per row: whether it might cost 0 at some shift. Costing 0 needs no cell already past
        capacity by a micro device-second's worth, and the row's summed load plus the job's
        summed share (the least over shifts) within its capacity over the horizon: what it
        overloads is at least that excess (a cell that is not hot is within `TINY` of it)."""
        h = self.horizon
        tolerance = 1e-6 / h.slot_s + h.slots * TINY + 1e-9
        return (row_max <= 1.0 + 1e-6 / h.slot_s + TINY) & (row_load + share.sum(axis=1).min() - h.slots <= tolerance)

    def _before_cool(self, order: np.ndarray, all_cool: np.ndarray, zero: np.ndarray, profile: JobProfile,
                     share: np.ndarray, units: np.ndarray, cool_rows: np.ndarray) -> Candidate:
        """`best` when a group of `order` is cool: the first group that scores 0 in tie order,
        the first cool group at the latest (shift 0, on devices costing 0). A group without
        enough rows that might cost 0 (`zero`, from `_may_be_free`) is passed over unprobed."""
        for lo_g in range(0, len(order), _BOUND_BLOCK):
            block = [int(g) for g in order[lo_g: lo_g + _BOUND_BLOCK]]
            cut = next((i for i, g in enumerate(block) if all_cool[g]), len(block))
            ahead = [g for g in block[:cut] if zero[g]]
            maybe = self.probes.may_score_zero(ahead, share, profile, cool_rows)
            for g in (g for g, may in zip(ahead, maybe) if may):
                found = self._scored(g, profile, share, units)
                if found.score == 0.0:
                    return found
            if cut < len(block):
                g = block[cut]
                lo, hi = self.view.group_rows[g]
                cost = self.device_costs(lo, share[:1], self.horizon.load[lo:hi] + share.max() > 1.0 + TINY)[:, 0]
                return Candidate(g, 0, 0.0, self.choose(g, cost, profile, units))
        raise AssertionError("a cool group is among the groups searched")

    def _best_first(self, order: np.ndarray, profile: JobProfile, share: np.ndarray, units: np.ndarray,
                    cool_rows: np.ndarray) -> Candidate:
        """`best` when no group is cool: groups scored in the order of their lower bounds (then
        of tie order); a group is skipped when its bound shows it cannot beat the best so far
        (a group later in tie order must score strictly less, an earlier one may tie), and the
        scoring stops at the first bound past the best score."""
        order = [int(g) for g in order]
        bounds = np.concatenate([self.probes.lower_bounds(order[lo: lo + _BOUND_BLOCK], share, profile, cool_rows)
                                 for lo in range(0, len(order), _BOUND_BLOCK)])
        best: Candidate | None = None
        best_rank = len(order)
        for rank in np.lexsort((np.arange(len(order)), bounds)).tolist():
            bound = bounds[rank]
            if best is not None:
                if bound > best.score:
                    break
                if rank > best_rank and (bound >= best.score or best.score <= 0.0):
                    continue
            found = self._scored(order[rank], profile, share, units)
            if best is None or found.score < best.score or (found.score == best.score and rank < best_rank):
                best, best_rank = found, rank
        return best

    def _scored(self, g: int, profile: JobProfile, share: np.ndarray, units: np.ndarray) -> Candidate:
        """Group `g`'s best shift (the smallest among equal scores) and devices."""
        lo, hi = self.view.group_rows[g]
        costs = self.device_costs(lo, share, self.horizon.load[lo:hi] + share.max() > 1.0 + TINY)
        scores = self.group_scores(g, costs, profile, units)
        k = int(np.argmin(scores))
        return Candidate(g, k, float(scores[k]), self.choose(g, costs[:, k], profile, units))

    def row_sums_and_maxima(self) -> tuple[np.ndarray, np.ndarray]:
        """Each row's summed load and its largest cell: `load.sum(axis=1)` and `load.max(axis=1)`
        bit for bit (each row reduced alone, the same way). Kept between decisions: while time
        stays in one slot, only the rows that jobs came onto or left since are reduced again
        (`Horizon.changed_since`; a queue retried, a move tried and undone); after time moves
        on, every row (`_reduce_rows`)."""
        h = self.horizon
        seen, sums, maxima = self._row_stats
        if seen != h.version:
            changed = h.changed_since(seen) if seen >= 0 else None
            if changed is None:
                sums, maxima = self._reduce_rows()
            elif len(changed):
                sums, maxima = sums.copy(), maxima.copy()  # a caller may hold the last answer
                sums[changed], maxima[changed] = h.load[changed].sum(axis=1), h.load[changed].max(axis=1)
            self._row_stats = (h.version, sums, maxima)
        return sums, maxima

    def _reduce_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """`row_sums_and_maxima` from scratch, passing over occupied rows only (an empty row
        holds only 0.0): by runs of consecutive ones (packing keeps them few), or, when they
        are fragmented, over every row in place (an empty row sums to 0.0 and peaks at 0.0, as
        it is left; copying the occupied rows out first cost more)."""
        load, occupied = self.horizon.load, self.tenancy.row_jobs > 0
        runs = np.flatnonzero(np.diff(occupied, prepend=False, append=False)).reshape(-1, 2)
        if len(runs) > _MAX_RUNS:
            return load.sum(axis=1), load.max(axis=1)
        sums, maxima = np.zeros(len(load)), np.zeros(len(load))
        for a, b in runs.tolist():
            sums[a:b], maxima[a:b] = load[a:b].sum(axis=1), load[a:b].max(axis=1)
        return sums, maxima

    def all_cool(self, cool_rows: np.ndarray, profile: JobProfile, units: np.ndarray) -> np.ndarray:
        """Per group: its nodes have enough whole replicas of devices without a hot cell (within
        host room), so the job scores 0 there at every shift."""
        cool = np.add.reduceat(cool_rows.astype(np.int64), self.tenancy.node_first_row) // profile.replica_devices
        fit = np.minimum(cool, units) * profile.replica_devices
        return np.add.reduceat(fit, self.view.group_first_node) >= profile.devices

    def device_costs(self, first_row: int, share: np.ndarray, hot: np.ndarray) -> np.ndarray:
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
            return self.row_costs(first_row, share, hot)
        first = np.unique(of_row, return_index=True)[1]  # each distinct row's first row, in number order
        return self.row_costs(first_row, share, hot, first)[of_row]

    def row_costs(self, first_row: int, share: np.ndarray, hot: np.ndarray,
                  only: np.ndarray | None = None) -> np.ndarray:
        """`device_costs` computed row by row for every row of `hot`, or for the rows `only`
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

    def group_scores(self, group: int, costs: np.ndarray, profile: JobProfile, units: np.ndarray) -> np.ndarray:
        """score[k]: the least total cost of the job's devices in `group` at shift k, in whole
        replicas per node within each node's host room (see the module docstring, step 3)."""
        size, lo = profile.replica_devices, self.view.group_rows[group][0]
        per_unit = []
        for node, cap in self._node_units(group, units):
            a, b = self.view.node_rows[node]
            ordered = np.sort(costs[a - lo: b - lo], axis=0)[: cap * size]
            per_unit.append(ordered.reshape(cap, size, -1).sum(axis=1))
        stacked = np.concatenate(per_unit)
        need = profile.devices // size
        return np.round(np.partition(stacked, need - 1, axis=0)[:need].sum(axis=0), 6)

    def choose(self, group: int, cost: np.ndarray, profile: JobProfile, units: np.ndarray) -> tuple[int, ...]:
        """The job's device rows in `group` for one shift's per-device `cost`: the choice
        `group_scores` scored, equal costs going to less carried load, then the lower row."""
        size, lo = profile.replica_devices, self.view.group_rows[group][0]
        carried = np.round(self.horizon.load[lo: self.view.group_rows[group][1]].sum(axis=1), 6)
        replicas = []  # (cost, carried, first row, rows)
        for node, cap in self._node_units(group, units):
            a, b = self.view.node_rows[node]
            ordered = sorted(range(a - lo, b - lo), key=lambda d: (cost[d], carried[d], d))[: cap * size]
            for i in range(0, len(ordered), size):
                unit = ordered[i: i + size]
                replicas.append((sum(cost[unit]), sum(carried[unit]), unit[0], unit))
        replicas.sort(key=lambda u: u[:3])
        return tuple(sorted(lo + d for u in replicas[: profile.devices // size] for d in u[3]))

    def _node_units(self, group: int, units: np.ndarray) -> list[tuple[int, int]]:
        """(node, replicas it can take) for the group's nodes that can take any."""
        first = int(self.view.group_first_node[group])
        return [(n, int(units[n])) for n in range(first, first + len(self.view.groups[group].nodes)) if units[n] > 0]

    def tie_order(self, groups: np.ndarray, row_load: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`groups` in the search's tie order (most carried load first, then topology order),
        with the load each carries (`_carried`), in that order."""
        carried = self._carried(groups, row_load)
        order = np.lexsort((groups, -carried))
        return groups[order], carried[order]

    def _carried(self, groups: np.ndarray, row_load: np.ndarray) -> np.ndarray:
        """Projected demand already on each group (rounded so float residue cannot break ties)."""
        bounds = self.tenancy.group_bounds[groups]
        per_row = np.concatenate(([0.0], np.cumsum(row_load)))
        return np.round(per_row[bounds[:, 1]] - per_row[bounds[:, 0]], 6)
