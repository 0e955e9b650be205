"""The placer's fast paths against plain references: twin rows costed once
(`device_costs` vs `row_costs` on every row), row reductions over occupied rows only and
probes over warm rows only (vs reducing and probing every row), the horizon's per-row index
(`names_on` vs filtering every job), and the refusal without a search (`refused_everywhere`:
whenever it answers Wait, the full search refuses too, and every decision equals that of a
placer without it)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from plexrl.bench.placement import random_profile
from plexrl.policy.horizon import Horizon
from plexrl.policy.placement import Placement, Placer, Wait, search
from plexrl.policy.placement.probes import ProbeBounds, _fits_on_probes
from plexrl.policy.placement.refusal import RefusalBound
from plexrl.policy.placement.search import DeviceSearch
from plexrl.policy.profile import JobProfile, ModelMemory
from plexrl.policy.resources import NodeResources, NodeGroup, ResourceView

GiB = 2**30
BUSY = (2, 2, 2, 2, 2, 2, 0, 0)  # busy 6 of 8 s per device: two such jobs cannot take turns
SHORT = (2, 2, 0, 0, 0, 0, 0, 0)  # busy 2 s of 8: such jobs take turns


def view(groups: int = 2, nodes: int = 1, devices: int = 2, host: int = 100 * GiB) -> ResourceView:
    return ResourceView.uniform(1, groups, nodes, devices, 10 * GiB, host)


def job(name: str, demand, barriers: int = 4, residual_s: float = 0.1, slack: float = 0.10,
        devices: int = 2, period_s: float | None = None, **rollouts) -> JobProfile:
    """`rollouts`: `JobProfile.rollout_barriers`, `rollout_residual_s`, `rollout_s` (elastic rollouts)."""
    return JobProfile(name, float(period_s or len(demand)), tuple(float(d) for d in demand), devices,
                      (ModelMemory("m", GiB, GiB),), slack, barriers=barriers, residual_s=residual_s, **rollouts)


class NeverRefuses(RefusalBound):
    def refused_everywhere(self, profile, groups, by_tenants=True):
        return None


class SearchAlways(Placer):
    """The reference: every decision goes through the search and the judgement."""

    def __init__(self, *args):
        super().__init__(*args)
        self.refusal = NeverRefuses(self.judgement)


# -- twin rows are costed once ---------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_twin_rows_cost_what_every_row_costs(seed):
    rng = np.random.default_rng(seed)
    placer = Placer(view(groups=1, nodes=2, devices=4), horizon_slots=32, slot_s=1.0)
    for i in range(5):  # jobs on overlapping device sets make twins and distinct rows
        rows = tuple(sorted(rng.choice(8, size=int(rng.choice([1, 2, 4])), replace=False)))
        demand = tuple(rng.random(int(rng.choice([4, 6, 8]))) * len(rows))
        placer.horizon.add(f"j{i}", rows, job(f"j{i}", demand, devices=len(rows)), float(rng.integers(0, 5)))
    share = rng.random((7, 32)) * 0.6
    hot = placer.horizon.load + share.max() > 1.0
    fast = placer.search.device_costs(0, share, hot)
    assert np.array_equal(fast, placer.search.row_costs(0, share, hot))  # bit for bit


# -- occupied rows and warm rows ---------------------------------------------------------------


def reference_probe_room(placer: Placer, groups, share):
    """`_probe_room` as it was: every row of the groups read."""
    spans = [placer.view.group_rows[g] for g in groups]
    rows = np.concatenate([np.arange(a, b) for a, b in spans])
    load = placer.horizon.load[rows]
    hot = load + share.max() > 1.0 + 1e-9
    cols = np.flatnonzero(hot.any(axis=0))
    cols = cols[:: max(1, len(cols) // 48)]
    return spans, np.where(hot[:, cols], 1.0 - load[:, cols], np.inf), cols


def reference_may_score_zero(placer: Placer, groups, share, profile):
    spans, room, cols = reference_probe_room(placer, groups, share)
    free = ~(share[:, None, cols] > (room + 1e-6 / placer.horizon.slot_s)[None]).any(axis=2)
    starts = np.cumsum([0] + [b - a for a, b in spans[:-1]])
    return (np.add.reduceat(free, starts, axis=1) >= profile.devices).any(axis=0)


def reference_lower_bounds(placer: Placer, groups, share, profile):
    spans, room, cols = reference_probe_room(placer, groups, share)
    over = share[:, None, cols] - room[None]
    per_row = np.maximum(over, 0.0, out=over).sum(axis=2) * placer.horizon.slot_s
    width = max(b - a for a, b in spans)
    padded = np.full((len(share), len(groups), width), np.inf)
    where = np.concatenate([i * width + np.arange(b - a) for i, (a, b) in enumerate(spans)])
    padded.reshape(len(share), -1)[:, where] = per_row
    need = profile.devices
    return np.round(np.partition(padded, need - 1, axis=2)[:, :, :need].sum(axis=2).min(axis=0) - 1e-6, 6)


def busy_placer(seed: int, steps: int = 40):
    """A placer after random places and releases of bench-like jobs (peaks of 0.3 to 1 device
    each), with the time now and a newcomer's (profile, share) at every step: groups of empty,
    cool and hot rows."""
    rng = np.random.default_rng(seed)
    placer = Placer(ResourceView.uniform(1, 3, 2, 4, 80 * GiB, 512 * GiB), horizon_slots=128, slot_s=1.0)
    for i in range(steps):
        now = 3.0 * i
        if placer.placements() and rng.random() < 0.3:
            placer.release(sorted(placer.placements())[int(rng.integers(len(placer.placements())))])
        devices = int(rng.choice([1, 2, 4, 8]))
        profile = random_profile(rng, f"j{i}", devices, int(rng.integers(8, 65)), slack=np.inf)
        profile = replace(profile, demand=tuple(np.asarray(profile.demand) * rng.uniform(0.3, 1.0)))
        placer.horizon.advance(now)
        shifts = placer.search.shift_slots(profile)
        yield placer, profile, placer.search.shifted_share(profile, now, shifts)
        placer.place(profile, now)


@pytest.mark.parametrize("max_runs", [0, 16])  # gathered, and slice by slice
@pytest.mark.parametrize("seed", range(4))
def test_row_reductions_over_occupied_rows_equal_those_over_every_row(seed, max_runs, monkeypatch):
    monkeypatch.setattr(search, "_MAX_RUNS", max_runs)
    for placer, _, _ in busy_placer(seed):
        sums, maxima = placer.search.row_sums_and_maxima()
        load = placer.horizon.load
        assert np.array_equal(sums, load.sum(axis=1)) and np.array_equal(maxima, load.max(axis=1))  # bit for bit


@pytest.mark.parametrize("seed", range(4))
def test_row_figures_kept_between_changes_equal_reducing_every_row(seed):
    """Row sums and maxima, and each group's column maxima, kept across places, releases and
    tentative moves at one time (only changed rows reduced again; `Horizon.changed_since`) and
    across time moving on, equal reducing the whole load after every change, bit for bit."""
    rng = np.random.default_rng(seed)
    placer = Placer(ResourceView.uniform(1, 3, 2, 4, 80 * GiB, 512 * GiB), horizon_slots=64, slot_s=1.0)
    now, kept = 0.0, 0
    for i in range(80):
        now += float(rng.choice([0.0, 0.0, 0.0, 0.5, 3.0]))  # mostly several changes in one slot
        if placer.placements() and rng.random() < 0.35:
            placer.release(sorted(placer.placements())[int(rng.integers(len(placer.placements())))])
        else:
            profile = random_profile(rng, f"j{i}", int(rng.choice([1, 2, 4])), int(rng.integers(8, 40)), slack=np.inf)
            placer.place(profile, now)
        kept += placer.horizon.changed_since(placer.search._row_stats[0]) is not None
        sums, maxima = placer.search.row_sums_and_maxima()
        load = placer.horizon.load
        assert np.array_equal(sums, load.sum(axis=1)) and np.array_equal(maxima, load.max(axis=1))
        groups = list(range(len(placer.view.groups)))
        reference = np.stack([load[slice(*placer.view.group_rows[g])].max(axis=0) for g in groups])
        assert np.array_equal(placer.search.probes.column_maxima(groups), reference)
    assert kept > 10  # the kept figures were reused, not only recomputed


@pytest.mark.parametrize("seed", range(4))
def test_a_row_that_costs_0_at_some_shift_is_one_that_may_be_free(seed):
    """`DeviceSearch._may_be_free` is a necessary condition: every row costing 0 at some shift
    (`row_costs` on every row) passes it, and it does rule rows out."""
    ruled_out = 0
    for placer, profile, share in busy_placer(seed, steps=60):
        load, s = placer.horizon.load, placer.search
        costs = s.row_costs(0, share, load + share.max() > 1.0 + 1e-9)
        sums, maxima = s.row_sums_and_maxima()
        may = s._may_be_free(sums, maxima, share)
        assert may[(costs == 0.0).any(axis=1)].all()
        ruled_out += (~may).sum()
    assert ruled_out > 0


@pytest.mark.parametrize("seed", range(4))
def test_probes_of_warm_rows_prune_what_probes_of_every_row_pruned(seed):
    """`lower_bounds` bit for bit; `may_score_zero`, whose probes are a superset, rules out
    at least the groups it ruled out with the even ones alone."""
    cool_seen = warm_seen = 0
    for placer, profile, share in busy_placer(seed):
        cool = placer.horizon.load.max(axis=1) + share.max() <= 1.0 + 1e-9
        groups = [int(g) for g in placer.view.feasible_groups(profile)]
        cool_seen, warm_seen = cool_seen + cool.sum(), warm_seen + (~cool).sum()
        for some in (groups, groups[1:2], groups[::-2]):
            if not some:
                continue
            may = placer.search.probes.may_score_zero(some, share, profile, cool)
            assert not (may & ~reference_may_score_zero(placer, some, share, profile)).any()  # prunes all it did
            assert np.array_equal(placer.search.probes.lower_bounds(some, share, profile, cool),
                                  reference_lower_bounds(placer, some, share, profile))
    assert cool_seen and warm_seen


def reference_feasible_groups(view: ResourceView, profile: JobProfile) -> np.ndarray:
    """Pod by pod as the search once went: a pod is skipped when no group in it can fit (too
    few devices, arenas too small, no node with host room for one copy)."""
    copies = view.units_per_node(profile) * profile.replica_devices
    per_group = np.add.reduceat(copies, view.group_first_node)
    pods = [g.pod for g in view.groups]
    found = []
    for pod in dict.fromkeys(pods):
        members = np.array([i for i, p in enumerate(pods) if p == pod])
        nodes = np.isin(view.node_group, members)
        free = view.node_host[nodes] - view.host_used[nodes]
        if (view.capacity[members].max() >= profile.devices and view.node_arena[nodes].max() >= profile.device_bytes
                and free.max() >= profile.host_bytes_per_device):
            found.append(members[per_group[members] >= profile.devices])
    return np.sort(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)


@pytest.mark.parametrize("seed", range(3))
def test_feasible_groups_equal_a_search_pod_by_pod(seed):
    """Mixed arenas, host sizes and shared models, filled and emptied at random."""
    rng = np.random.default_rng(seed)
    groups = [NodeGroup(f"p{p}/g{g}", f"p{p}", tuple(
        NodeResources(f"p{p}/g{g}/n{n}", tuple(range(8 * (4 * p + 2 * g + n), 8 * (4 * p + 2 * g + n) + int(rng.choice([2, 4, 8])))),
             int(rng.choice([20, 80])) * GiB, int(rng.choice([100, 300])) * GiB) for n in range(2)))
        for p in range(3) for g in range(2)]
    cluster = ResourceView(groups)
    held = []
    for i in range(80):
        devices, replica = [(1, 1), (2, 1), (4, 2), (8, 2), (8, 8), (16, 4)][int(rng.integers(6))]
        shared = str(rng.choice(["", "base"]))
        profile = JobProfile(f"j{i}", 4.0, (1.0,) * 4, devices, (
            ModelMemory("policy", int(rng.choice([10, 40])) * GiB, int(rng.choice([0, 20, 60])) * GiB),
            ModelMemory("ref", GiB, 30 * GiB, shared)), replica_devices=replica)
        fits = cluster.feasible_groups(profile)
        assert np.array_equal(fits, reference_feasible_groups(cluster, profile)) and fits.dtype == np.int64
        if len(fits) and rng.random() < 0.7:
            chosen = cluster.choose_devices(int(fits[0]), profile)
            cluster.allocate(profile.job, chosen, profile.host_bytes_per_device, profile.shared_host_bytes)
            held.append(profile.job)
        elif held:
            cluster.free(held.pop(int(rng.integers(len(held)))))


@pytest.mark.parametrize("probes", [5, 12, 13, 48])
@pytest.mark.parametrize("passing", [0.02, 0.5, 0.99])  # how often one probe passes: few, some, most pairs survive the head
def test_fits_on_probes_equals_testing_every_probe(probes, passing):
    rng = np.random.default_rng(probes)
    share = rng.random((40, probes))
    room = np.where(rng.random((30, probes)) < passing ** (1 / 4), np.inf, rng.random((30, probes)) * 0.5)
    room[rng.random(room.shape) < 0.1] = share.max()  # ties pass
    expected = ~(share[:, None, :] > room[None]).any(axis=2)
    assert np.array_equal(_fits_on_probes(share, room), expected)


class EvenProbeBounds(ProbeBounds):
    """The reference for `_evenly_and_scattered`: `may_score_zero` on every row, evenly spread probes."""

    def may_score_zero(self, groups, share, profile, cool_rows):
        return reference_may_score_zero(self, groups, share, profile) if groups else np.zeros(0, dtype=bool)


class CountedSearch(DeviceSearch):
    scored = 0

    def device_costs(self, first_row, share, hot):
        self.scored += 1
        return super().device_costs(first_row, share, hot)


class Counted(Placer):
    def __init__(self, *args):
        super().__init__(*args)
        self.search = CountedSearch(self.tenancy, self.max_shifts)

    @property
    def scored(self):
        return self.search.scored


class EvenProbes(Counted):
    def __init__(self, *args):
        super().__init__(*args)
        self.search.probes = EvenProbeBounds(self.view, self.horizon)


def test_scattered_probes_give_the_decisions_of_even_ones_scoring_fewer_groups():
    """Bench-like jobs whose periods divide the even probe stride (an aliased stride reads
    the job at one phase) on a cluster with room: the same placements, fewer groups scored."""
    rng = np.random.default_rng(0)
    cluster = lambda: ResourceView.uniform(2, 8, 2, 4, 80 * GiB, 512 * GiB)  # noqa: E731
    fast, slow = Counted(cluster(), 256, 1.0), EvenProbes(cluster(), 256, 1.0)
    for i in range(60):
        profile = random_profile(rng, f"j{i}", int(rng.choice([1, 2, 4, 8])), int(rng.choice([5, 10, 16, 21, 40])))
        assert fast.place(profile, 5.0 * i) == slow.place(profile, 5.0 * i)
    assert fast.scored < slow.scored


def reference_shifted_share(placer: Placer, profile: JobProfile, now: float, shifts) -> np.ndarray:
    """One window per shift read from the projection, put in ring order, then divided."""
    h, top = placer.horizon, int(shifts[-1])
    extended = h.project(profile, now, h.origin - top, h.slots + top)
    by_time = np.lib.stride_tricks.sliding_window_view(extended, h.slots)[top - shifts]
    return by_time[:, h.positions()] / profile.devices


@pytest.mark.parametrize("seed", range(3))
def test_shifted_share_equals_windows_of_the_projection(seed):
    seen = 0
    for placer, profile, _ in busy_placer(seed, steps=12):
        for now in (placer.horizon.origin * 1.0, placer.horizon.origin + 0.37):
            shifts = placer.search.shift_slots(profile)
            got = placer.search.shifted_share(profile, now, shifts)
            assert np.array_equal(got, reference_shifted_share(placer, profile, now, shifts))
            seen += len(shifts) > 1 and placer.horizon.origin % placer.horizon.slots > 0
    assert seen  # several shifts, on a ring turned from its start


# -- the horizon's row index -------------------------------------------------------------------


def test_names_on_equals_filtering_every_job_after_any_history():
    rng = np.random.default_rng(0)
    horizon, placed = Horizon(6, 16, 1.0), {}
    for i in range(60):
        if placed and rng.random() < 0.4:
            gone = sorted(placed)[int(rng.integers(len(placed)))]
            horizon.remove(gone)
            del placed[gone]
        else:
            rows = tuple(int(r) for r in rng.choice(6, size=int(rng.integers(1, 4)), replace=False))
            horizon.add(f"j{i}", rows, job(f"j{i}", (1, 0, 0, 0), devices=len(rows)), 0.0)
            placed[f"j{i}"] = rows
        for row in range(6):
            expected = tuple(j for j, (rows, _, _) in horizon._jobs.items() if row in rows)
            assert horizon.names_on(row) == expected
            assert [j for j, *_ in horizon.jobs_on(row)] == list(expected)


# -- refusing without a search ---------------------------------------------------------------

REFUSALS = {
    # name: (view, jobs placed first, the newcomer, expected: "search" or words of the Wait)
    "the newcomer's own wait bound is past its slack on every group": (
        # a on every device: 4 barriers x 1.0 s residual / 8 s = 50% on any devices
        view(groups=1), [job("a", BUSY, residual_s=1.0, slack=1.0)], job("b", BUSY, residual_s=1.0),
        "would be slowed by 50% or more"),
    "every device carries a tenant it would push past its slack": (
        view(groups=1), [job("a", BUSY, residual_s=1.0)], job("b", BUSY, residual_s=1.0, slack=1.0),
        "would slow job 'a' or another co-tenant"),
    "an empty group leaves it to the search": (
        view(groups=2), [job("a", BUSY, residual_s=1.0)], job("b", BUSY, residual_s=1.0), "search"),
    "tenants that take turns leave it to the search": (
        view(groups=1), [job("a", SHORT, residual_s=1.0)], job("b", SHORT, residual_s=1.0), "search"),
    # 50% + 55% busy: waits of 4 x 0.1 / 20 = 2% each, stretched to the devices' capacity: 5%
    "short calls within slack leave it to the search": (
        view(groups=1), [job("a", (2,) * 10 + (0,) * 10, residual_s=0.1)],
        job("b", (2,) * 11 + (0,) * 9, residual_s=0.1), "search"),
    # two jobs busy 75% each cannot both run within 10%, short calls or not: the devices would
    # have to run 150% of the time, so each runs 50% slow (the pair's inflation, exactly)
    "near-always-busy tenants refuse however short the calls": (
        view(groups=1), [job("a", BUSY, residual_s=0.1)], job("b", BUSY, residual_s=0.1),
        "would be slowed by 50% or more"),
    # they take turns, but the newcomer is held to the tenant's 16 s period: 100% slower
    "a tenant that takes turns at twice the period refuses (the pair's inflation)": (
        view(groups=1), [job("a", SHORT + (0,) * 8, residual_s=1.0, slack=1.0)], job("b", SHORT, residual_s=1.0),
        "would be slowed by 100% or more"),
    # the same, with room to spare for a newcomer that tolerates it
    "a tenant that takes turns within the newcomer's slack leaves it to the search": (
        view(groups=1), [job("a", SHORT + (0,) * 8, residual_s=1.0, slack=1.0)],
        job("b", SHORT, residual_s=1.0, slack=1.5), "search"),
    # one device each: any two devices carry both tenants, which take turns with it only if all
    # three do; two of 25% and it at 25% could, held to the slower tenant's 16 s: 100%
    "two tenants that could take turns together bound it by the second-shortest period": (
        view(groups=1), [job("a", (1, 1) + (0,) * 14, residual_s=1.0, slack=1.0, devices=1),
                         job("c", (1, 1) + (0,) * 14, residual_s=1.0, slack=1.0, devices=1)],
        job("b", SHORT, residual_s=1.0), "would be slowed by"),
    "a newcomer that does not know its calls is searched (fluid model)": (
        view(groups=1), [job("a", BUSY, residual_s=1.0)], job("b", BUSY, barriers=0, residual_s=0.0), "search"),
    "a tenant that does not know its calls means a search": (
        view(groups=1), [job("a", BUSY, barriers=0, residual_s=0.0)], job("b", BUSY, residual_s=1.0), "search"),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_refusal_table(name):
    cluster, placed, newcomer, expected = REFUSALS[name]
    placer = Placer(cluster, horizon_slots=32, slot_s=1.0)
    for p in placed:
        assert isinstance(placer.place(p, 0.0), Placement)
    placer.horizon.advance(0.0)
    early = placer.refusal.refused_everywhere(newcomer, cluster.feasible_groups(newcomer))
    if expected == "search":
        assert early is None
    else:
        assert isinstance(early, Wait) and expected in early.reason, early
        assert isinstance(placer.decide(newcomer, 0.0), Wait)


def test_the_bound_by_tenants_never_exceeds_the_judgements_inflation_on_any_devices():
    """`_by_tenants` against the call model on every choice of the newcomer's devices in a
    group, over random tenants (periods, busy shares and calls that do and do not take turns)."""
    from itertools import combinations

    from plexrl.policy.placement.refusal import _by_tenants, _TenantFacts

    rng = np.random.default_rng(7)
    tight = 0
    for case in range(150):
        placer = Placer(view(groups=1, nodes=2, devices=3), horizon_slots=32, slot_s=1.0)
        for i in range(int(rng.integers(1, 5))):
            period = int(rng.choice([4, 8, 16]))
            busy = int(rng.integers(1, period))
            demand = (1.0,) * busy + (0.0,) * (period - busy)
            placer.place(job(f"t{i}", demand, barriers=int(rng.integers(1, 5)), residual_s=float(rng.random()),
                             slack=5.0, devices=int(rng.integers(1, 4))), 0.0)
        period = int(rng.choice([4, 8, 16]))
        busy = int(rng.integers(1, period))
        newcomer = job("n", (1.0,) * busy + (0.0,) * (period - busy), barriers=int(rng.integers(1, 5)),
                       residual_s=float(rng.random()), devices=int(rng.integers(1, 4)))
        refusal, tenancy = placer.refusal, placer.tenancy
        cells = {}
        runs = refusal._group_runs(newcomer, 0, placer.view.units_per_node(newcomer), cells)
        bound = _by_tenants(newcomer, runs, cells, _TenantFacts(newcomer, tenancy.placed))
        rows = range(*placer.view.group_rows[0])
        least = min(placer.judgement.call_inflation(newcomer, tenancy.tenants(list(chosen)), list(chosen))
                    for chosen in combinations(rows, newcomer.devices))
        assert bound <= least + 1e-9, (case, bound, least)
        tight += bound > refusal._own_bound(newcomer, runs, cells) + 1e-9
    assert tight > 0  # it does raise the cells' bound


def replay(seed: int, *placers: Placer, runs: bool = False) -> tuple[list[list], int]:
    """Random call-model histories (places, observations, releases) on a small cluster of 2
    nodes per group, applied to every placer alike: the answers of each, and how many
    decisions the first placer's refusal shortcut answered."""
    rng = np.random.default_rng(seed)
    answers, shortcut = [[] for _ in placers], 0
    now, placed = 0.0, []
    for i in range(60):
        now += float(rng.integers(0, 4))
        op = rng.random()
        if placed and op < 0.25:
            gone = placed.pop(int(rng.integers(len(placed))))
            for p in placers:
                p.release(gone)
            continue
        if placed and op < 0.4:
            who = placed[int(rng.integers(len(placed)))]
            measured = round(float(rng.random() * 0.3), 2)
            for p in placers:
                p.observe(who, measured)
            continue
        period = int(rng.choice([4, 8, 12]))
        devices = int(rng.choice([1, 2, 4]))
        demand = tuple(rng.integers(0, devices + 1, period).astype(float))
        barriers, residual_s = int(rng.integers(1, 6)), float(rng.random() * 2)
        rollouts = {}
        if rng.random() < 0.5:  # elastic rollouts: some of its barriers and residual, some of its period
            rollouts = {"rollout_barriers": int(rng.integers(0, barriers + 1)),
                        "rollout_residual_s": float(rng.random() * residual_s),
                        "rollout_s": float(rng.random() * period)}
        profile = job(f"j{i}", demand, barriers=barriers, residual_s=residual_s,
                      slack=float(rng.choice([0.1, 0.3, 1.0])), devices=devices, **rollouts)
        if runs:  # declared runs: packing by effect judges shared placements
            profile = replace(profile, ends=True, steps=int(rng.integers(1, 40)))
        first = placers[0]
        first.horizon.advance(now)
        groups = first.view.feasible_groups(profile)
        shortcut += len(groups) > 0 and first.refusal.refused_everywhere(profile, groups) is not None
        for p, got in zip(placers, answers):
            got.append(p.place(profile, now))
        if isinstance(got[-1], Placement):
            placed.append(profile.job)
    return answers, shortcut


def cluster() -> ResourceView:
    return view(groups=3, nodes=2, devices=2, host=6 * GiB)  # host room for 3 copies a node


@pytest.mark.parametrize("runs", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_decisions_equal_those_of_always_searching(seed, runs):
    """Every answer equals the reference's, Waits and placements alike, and the shortcut did
    answer some of them; with declared runs, packing by effect refuses too (`_costs_more`)."""
    (fast, slow), shortcut = replay(seed, Placer(cluster(), 32, 1.0), SearchAlways(cluster(), 32, 1.0), runs=runs)
    assert [isinstance(a, Wait) for a in fast] == [isinstance(a, Wait) for a in slow]
    assert [a for a in fast if isinstance(a, Placement)] == [a for a in slow if isinstance(a, Placement)]
    assert shortcut > 0


class Uncached(Placer):
    """The reference for `Judgement.cotenants`: a placed job's co-tenants recomputed at every question."""

    def __init__(self, *args):
        super().__init__(*args)
        cotenants = self.judgement.cotenants

        def recomputed(job):
            self.tenancy.derived.cotenants.clear()
            return cotenants(job)
        self.judgement.cotenants = recomputed


@pytest.mark.parametrize("seed", range(6))
def test_cotenants_kept_between_changes_give_the_answers_of_recomputing_them(seed):
    (cached, uncached), _ = replay(seed, Placer(cluster(), 32, 1.0), Uncached(cluster(), 32, 1.0))
    assert cached == uncached  # Wait reasons included
    assert any(isinstance(a, Wait) for a in cached) and any(isinstance(a, Placement) for a in cached)
