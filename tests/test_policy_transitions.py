"""Transition planning: named cases and properties (budgets, busy states, residency)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl.policy import LoadPlan, NoFit, ResidencyView, StateInfo, Tier, TransitionKind, plan_load


def view(states, device_capacity=None, host_capacity=1000):
    return ResidencyView({s.state_id: s for s in states}, device_capacity or {0: 100, 1: 100}, host_capacity)


def st_(sid, size, tier=Tier.HOST, device=None, offset=None, busy=False, pending=0, last=0.0, job="j"):
    return StateInfo(sid, job, size, size, tier, device, offset, busy, pending, last)


def kinds(plan):
    return [(t.kind.value, t.state_id) for t in plan.transitions]


def test_resident_state_needs_nothing():
    plan = plan_load(view([st_("a", 40, Tier.DEVICE, 0, 0)]), "a", 0)
    assert plan == LoadPlan("a", 0, 0, ())
    assert not plan.is_switch


def test_free_space_is_used_without_eviction():
    plan = plan_load(view([st_("a", 40, Tier.DEVICE, 0, 0), st_("b", 50)]), "b", 0)
    assert kinds(plan) == [("load", "b")] and plan.offset == 40


def test_idle_state_is_evicted_before_one_with_queued_work():
    states = [st_("busy_soon", 50, Tier.DEVICE, 0, 0, pending=2), st_("idle", 50, Tier.DEVICE, 0, 50, last=9.0),
              st_("new", 50)]
    plan = plan_load(view(states), "new", 0)
    assert kinds(plan) == [("offload", "idle"), ("load", "new")] and plan.offset == 50


def test_least_recently_used_goes_first_among_idle():
    states = [st_("old", 50, Tier.DEVICE, 0, 0, last=1.0), st_("recent", 50, Tier.DEVICE, 0, 50, last=5.0), st_("new", 50)]
    assert kinds(plan_load(view(states), "new", 0))[0] == ("offload", "old")


def test_busy_states_are_never_moved():
    states = [st_("a", 60, Tier.DEVICE, 0, 0, busy=True), st_("new", 50)]
    assert isinstance(plan_load(view(states), "new", 0), NoFit)


def test_state_resident_elsewhere_moves_over():
    plan = plan_load(view([st_("a", 40, Tier.DEVICE, 1, 0)]), "a", 0)
    assert kinds(plan) == [("offload", "a"), ("load", "a")]
    assert plan.transitions[0].device == 1 and plan.transitions[1].device == 0


def test_disk_state_restores_after_spilling_for_host_room():
    states = [st_("cold", 60, Tier.DISK), st_("warm", 60, Tier.HOST, last=1.0)]
    plan = plan_load(view(states, host_capacity=100), "cold", 0)
    assert kinds(plan) == [("spill", "warm"), ("restore", "cold"), ("load", "cold")]


def test_a_state_without_host_bytes_of_its_own_is_never_spilled():
    """A read replica (host copy: its primary's) frees nothing by spilling: the host room comes
    from a state that holds host bytes, even one used more recently."""
    replica = StateInfo("snap#1", "j", 60, 0, Tier.HOST, last_used_s=0.0)
    states = [st_("cold", 60, Tier.DISK), replica, st_("warm", 60, Tier.HOST, last=5.0)]
    plan = plan_load(view(states, host_capacity=100), "cold", 0)
    assert kinds(plan) == [("spill", "warm"), ("restore", "cold"), ("load", "cold")]


def test_too_big_for_the_device_names_the_budget():
    plan = plan_load(view([st_("huge", 500)]), "huge", 0)
    assert isinstance(plan, NoFit) and "budget" in plan.reason and "500" in plan.reason


@st.composite
def residencies(draw):
    capacity = {0: draw(st.integers(50, 200)), 1: draw(st.integers(50, 200))}
    host_capacity = draw(st.integers(100, 600))
    states, used, host_used = [], {0: 0, 1: 0}, 0
    for i in range(draw(st.integers(1, 8))):
        size = draw(st.integers(1, 120))
        tier = draw(st.sampled_from(list(Tier)))
        device = offset = None
        if tier is not Tier.DISK:
            if host_used + size > host_capacity:
                tier = Tier.DISK
            else:
                host_used += size
        if tier is Tier.DEVICE:
            device = draw(st.integers(0, 1))
            if used[device] + size > capacity[device]:
                tier = Tier.HOST
                device = None
            else:
                offset, used[device] = used[device], used[device] + size
        states.append(st_(f"s{i}", size, tier, device, offset, busy=draw(st.booleans()) and tier is Tier.DEVICE,
                          pending=draw(st.integers(0, 2)), last=float(draw(st.integers(0, 9)))))
    return view(states, capacity, host_capacity)


def apply(v: ResidencyView, plan: LoadPlan) -> dict:
    """Replay a plan on plain dicts; returns final {state: (tier, device, offset)}."""
    where = {s.state_id: (s.tier, s.device, s.offset) for s in v.states.values()}
    for t in plan.transitions:
        if t.kind is TransitionKind.OFFLOAD:
            where[t.state_id] = (Tier.HOST, None, None)
        elif t.kind is TransitionKind.SPILL:
            where[t.state_id] = (Tier.DISK, None, None)
        elif t.kind is TransitionKind.RESTORE:
            where[t.state_id] = (Tier.HOST, None, None)
        elif t.kind is TransitionKind.LOAD:
            where[t.state_id] = (Tier.DEVICE, t.device, t.offset)
    return where


@settings(max_examples=300, deadline=None)
@given(v=residencies(), target_index=st.integers(0, 7), device=st.integers(0, 1))
def test_plans_respect_budgets_and_busy_states(v, target_index, device):
    ids = sorted(v.states)
    target = ids[target_index % len(ids)]
    if v.states[target].busy:
        return
    plan = plan_load(v, target, device)
    if isinstance(plan, NoFit):
        return
    where = apply(v, plan)
    assert where[target] == (Tier.DEVICE, device, plan.offset)
    for sid, s in v.states.items():
        if s.busy:
            assert where[sid] == (s.tier, s.device, s.offset), "a busy state moved"
    for d, cap in v.device_capacity.items():
        regions = sorted((where[sid][2], v.states[sid].device_bytes) for sid in where if where[sid][:2] == (Tier.DEVICE, d))
        assert sum(size for _, size in regions) <= cap
        for (o1, s1), (o2, _) in zip(regions, regions[1:]):
            assert o1 + s1 <= o2, "regions overlap"
        assert all(o + s <= cap for o, s in regions)
    host = sum(v.states[sid].host_bytes for sid in where if where[sid][0] is not Tier.DISK)
    assert host <= max(v.host_capacity, v.host_used())
