"""Placement properties (hypothesis): memory is never over-committed, the chosen phase shift is
never worse than no shift on the same group, and the same inputs give the same decision."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl.policy.placement import Placement, Placer, Wait
from plexrl.policy.profile import JobProfile, ModelMemory
from plexrl.policy.resources import NodeResources, NodeGroup, ResourceView

GiB = 2**30

@st.composite
def clusters(draw) -> ResourceView:
    """Up to 2 pods x 3 groups x 2 nodes, every node with its own device count, arena and host."""
    groups, device = [], 0
    for p in range(draw(st.integers(1, 2))):
        for g in range(draw(st.integers(1, 3))):
            nodes = []
            for n in range(draw(st.integers(1, 2))):
                count = draw(st.integers(1, 3))
                arena, host = draw(st.integers(4, 16)) * GiB, draw(st.integers(8, 64)) * GiB
                nodes.append(NodeResources(f"p{p}g{g}n{n}", tuple(range(device, device + count)), arena, host))
                device += count
            groups.append(NodeGroup(f"p{p}/g{g}", f"p{p}", tuple(nodes)))
    return ResourceView(groups)


@st.composite
def profiles(draw, name: str) -> JobProfile:
    devices = draw(st.integers(1, 4))
    slots = draw(st.integers(1, 10))
    demand = draw(st.lists(st.floats(0.0, float(devices)), min_size=slots, max_size=slots))
    models = tuple(
        ModelMemory(f"m{i}", draw(st.integers(1, 16)) * GiB, draw(st.integers(0, 12)) * GiB)
        for i in range(draw(st.integers(1, 3)))
    )
    period = draw(st.floats(0.5, 30.0))
    return JobProfile(name, period, tuple(demand), devices, models, draw(st.sampled_from([0.1, 0.5, np.inf])))


@st.composite
def histories(draw) -> list[tuple[str, JobProfile | int, float]]:
    """A sequence of ("place", profile, now) and ("release", index of an earlier job, now)."""
    ops, now = [], 0.0
    for i in range(draw(st.integers(1, 10))):
        now += draw(st.floats(0.0, 20.0))
        if i and draw(st.booleans()):
            ops.append(("release", draw(st.integers(0, i - 1)), now))
        else:
            ops.append(("place", draw(profiles(f"j{i}")), now))
    return ops


def run(placer: Placer, ops) -> list[Placement | Wait | None]:
    decisions, names = [], []
    for kind, what, now in ops:
        if kind == "place":
            names.append(what.job)
            decisions.append(placer.place(what, now))
        else:
            if names:
                placer.release(names[what % len(names)])
            decisions.append(None)
    return decisions


def assert_memory_respected(placer: Placer) -> None:
    view = placer.view
    assert (view.host_used <= view.node_host).all()
    expected_host = np.zeros_like(view.host_used)
    node_of = {d: n for n, node in enumerate(view.nodes) for d in node.devices}
    for job, placement in placer.placements().items():
        profile = placer.profile_of(job)
        group = view.groups[view.index[placement.group]]
        assert len(set(placement.devices)) == profile.devices
        assert set(placement.devices) <= set(group.devices)
        for d in placement.devices:
            assert view.nodes[node_of[d]].device_bytes >= profile.device_bytes
            expected_host[node_of[d]] += profile.host_bytes_per_device
    assert (view.host_used == expected_host).all()


@settings(max_examples=60, deadline=None)
@given(view=clusters(), ops=histories())
def test_placements_never_exceed_device_or_host_memory(view, ops):
    placer = Placer(view, horizon_slots=32, slot_s=1.0)
    for op in ops:
        run(placer, [op])
        assert_memory_respected(placer)


def zero_shift_score(placer: Placer, profile: JobProfile, group: str, now: float) -> float:
    """Plain numpy: the job started at the first slot boundary from now (what a shift of 0
    means) on its best devices of `group` (every subset the node and host rules allow),
    per-device overload summed."""
    h, view = placer.horizon, placer.view
    h.advance(now)
    start = np.ceil(now / h.slot_s - 1e-9) * h.slot_s
    share = h.project(profile, start, h.origin, h.slots) / profile.devices
    node_of = {d: n for n, node in enumerate(view.nodes) for d in node.devices}
    room = view.units_per_node(profile) * profile.replica_devices
    best = np.inf
    for subset in itertools.combinations(view.groups[view.index[group]].devices, profile.devices):
        per_node = np.bincount([node_of[d] for d in subset], minlength=len(view.nodes))
        if (per_node > room).any():
            continue
        over = sum(np.maximum(h.window(view.device_rows[d]) + share - 1.0, 0.0).sum() for d in subset)
        best = min(best, float(over * h.slot_s))
    return best


@settings(max_examples=60, deadline=None)
@given(view=clusters(), ops=histories())
def test_the_chosen_shift_is_never_worse_than_no_shift(view, ops):
    placer = Placer(view, horizon_slots=32, slot_s=1.0)
    names = []
    for kind, what, now in ops:
        if kind == "release":
            if names:
                placer.release(names[what % len(names)])
            continue
        names.append(what.job)
        decision = placer.decide(what, now)
        if isinstance(decision, Placement):
            assert decision.score <= zero_shift_score(placer, what, decision.group, now) + 1e-5
            placer.commit(what, decision, now)


@settings(max_examples=40, deadline=None)
@given(view=clusters(), ops=histories(), extra=profiles("probe"))
def test_the_same_inputs_give_the_same_decision(view, ops, extra):
    first = Placer(view, horizon_slots=32, slot_s=1.0)
    second = Placer(ResourceView(view.groups), horizon_slots=32, slot_s=1.0)
    assert run(first, ops) == run(second, ops)
    now = ops[-1][2] + 1.0
    assert first.decide(extra, now) == first.decide(extra, now) == second.decide(extra, now)
