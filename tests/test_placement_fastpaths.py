"""The placer's fast paths against plain references: twin rows costed once
(`_device_costs` vs `_row_costs` on every row), the horizon's per-row index (`names_on` vs
filtering every job), and the refusal without a search (`_refused_everywhere`: whenever it
answers Wait, the full search refuses too, and every decision equals that of a placer
without it)."""

from __future__ import annotations

import numpy as np
import pytest

from plexrl.policy.horizon import Horizon
from plexrl.policy.placement import Placement, Placer, Wait
from plexrl.policy.profile import JobProfile, ModelMemory
from plexrl.policy.resources import ResourceView

GiB = 2**30
BUSY = (2, 2, 2, 2, 2, 2, 0, 0)  # busy 6 of 8 s per device: two such jobs cannot take turns
SHORT = (2, 2, 0, 0, 0, 0, 0, 0)  # busy 2 s of 8: such jobs take turns


def view(groups: int = 2, nodes: int = 1, devices: int = 2, host: int = 100 * GiB) -> ResourceView:
    return ResourceView.uniform(1, groups, nodes, devices, 10 * GiB, host)


def job(name: str, demand, barriers: int = 4, residual_s: float = 0.1, slack: float = 0.10,
        devices: int = 2, period_s: float | None = None) -> JobProfile:
    return JobProfile(name, float(period_s or len(demand)), tuple(float(d) for d in demand), devices,
                      (ModelMemory("m", GiB, GiB),), slack, barriers=barriers, residual_s=residual_s)


class SearchAlways(Placer):
    """The reference: every decision goes through the search and `_judge`."""

    def _refused_everywhere(self, profile, groups):
        return None


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
    fast = placer._device_costs(0, share, hot)
    assert np.array_equal(fast, placer._row_costs(0, share, hot))  # bit for bit


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
    "short calls within slack leave it to the search": (
        view(groups=1), [job("a", BUSY, residual_s=0.1)], job("b", BUSY, residual_s=0.1), "search"),
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
    early = placer._refused_everywhere(newcomer, cluster.feasible_groups(newcomer))
    if expected == "search":
        assert early is None
    else:
        assert isinstance(early, Wait) and expected in early.reason, early
        assert isinstance(placer.decide(newcomer, 0.0), Wait)


@pytest.mark.parametrize("seed", range(6))
def test_decisions_equal_those_of_always_searching(seed):
    """Random call-model histories (places, observations, releases) on a small cluster of 2
    nodes per group: every answer equals the reference's, Waits and placements alike, and the
    shortcut did answer some of them."""
    rng = np.random.default_rng(seed)
    cluster = lambda: view(groups=3, nodes=2, devices=2, host=6 * GiB)  # noqa: E731 - host room for 3 copies a node
    fast, slow = Placer(cluster(), 32, 1.0), SearchAlways(cluster(), 32, 1.0)
    shortcut = 0
    now, placed = 0.0, []
    for i in range(60):
        now += float(rng.integers(0, 4))
        op = rng.random()
        if placed and op < 0.25:
            gone = placed.pop(int(rng.integers(len(placed))))
            fast.release(gone), slow.release(gone)
            continue
        if placed and op < 0.4:
            who = placed[int(rng.integers(len(placed)))]
            measured = round(float(rng.random() * 0.3), 2)
            fast.observe(who, measured), slow.observe(who, measured)
            continue
        period = int(rng.choice([4, 8, 12]))
        devices = int(rng.choice([1, 2, 4]))
        demand = tuple(rng.integers(0, devices + 1, period).astype(float))
        profile = job(f"j{i}", demand, barriers=int(rng.integers(1, 6)), residual_s=float(rng.random() * 2),
                      slack=float(rng.choice([0.1, 0.3, 1.0])), devices=devices)
        fast.horizon.advance(now)
        groups = fast.view.feasible_groups(profile)
        shortcut += len(groups) > 0 and fast._refused_everywhere(profile, groups) is not None
        got, expected = fast.place(profile, now), slow.place(profile, now)
        assert isinstance(got, Wait) == isinstance(expected, Wait)
        if isinstance(got, Placement):
            assert got == expected
            placed.append(profile.job)
    assert shortcut > 0
