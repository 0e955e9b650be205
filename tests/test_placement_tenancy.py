"""The placer's derived caches and their one invalidation point (`placement/tenancy.py`):
every change of what is placed (`hold`, `release`) drops what its node groups touch, a question
after it answers as if computed afresh, and an undone move rewinds them with the release count."""

from __future__ import annotations

import numpy as np

from plexrl.policy.placement import Placement, Placer
from plexrl.policy.placement.tenancy import Derived
from plexrl.policy.profile import JobProfile, ModelMemory
from plexrl.policy.resources import ResourceView

GiB = 2**30
BUSY = (1, 1, 1, 1, 1, 1, 0, 0)  # per device


def job(name: str, devices: int = 1, demand=BUSY, host: int = 4 * GiB) -> JobProfile:
    return JobProfile(name, float(len(demand)), tuple(float(d) * devices for d in demand), devices,
                      (ModelMemory("m", GiB, host),), 1.0, barriers=4, residual_s=0.2)


def placer() -> Placer:
    return Placer(ResourceView.uniform(1, 2, 1, 2, 10 * GiB, 100 * GiB), horizon_slots=16, slot_s=1.0)


def ask_everything(p: Placer) -> None:
    """Fill every derived cache."""
    for job_name in p.placements():
        p.judgement.cotenants(job_name)
    for node in range(len(p.view.node_rows)):
        p.tenancy.tenancies(node)
    p.tenancy.unused()


def fresh_answers(p: Placer) -> tuple:
    kept = p.tenancy.derived
    p.tenancy.derived = Derived()
    try:
        ask_everything(p)
        d = p.tenancy.derived
        return d.cotenants, d.node_tenancy, d.unused.tolist()
    finally:
        p.tenancy.derived = kept


def test_hold_and_release_drop_what_the_changed_groups_touch_and_keep_the_rest():
    p = placer()
    for name in ("a", "b", "c"):
        before = p.tenancy.derived
        ask_everything(p)
        asked = p.tenancy.derived
        assert isinstance(p.place(job(name), 0.0), Placement)
        d = p.tenancy.derived
        assert d is not asked and d.unused is None
        group = p.view.index[p.placements()[name].group]
        nodes = range(int(p.view.group_first_node[group]), int(p.view.group_first_node[group]) + 1)
        assert not set(d.node_tenancy) & set(nodes)  # the changed group's nodes are dropped
        on_group = {j for j, pl in p.placements().items() if p.view.index[pl.group] == group}
        assert not set(d.cotenants) & on_group  # and the co-tenants of every job on it
        assert set(d.node_tenancy) == set(asked.node_tenancy) - set(nodes)  # the rest is kept
        ask_everything(p)
        assert (d.cotenants, d.node_tenancy, d.unused.tolist()) == fresh_answers(p)
        assert before is not d
    asked = p.tenancy.derived
    p.release("b")
    assert p.tenancy.derived is not asked and p.tenancy.releases == 1
    ask_everything(p)
    d = p.tenancy.derived
    assert (d.cotenants, d.node_tenancy, d.unused.tolist()) == fresh_answers(p)


def test_kept_answers_equal_fresh_ones_after_any_history():
    rng = np.random.default_rng(3)
    p = Placer(ResourceView.uniform(1, 3, 2, 2, 10 * GiB, 100 * GiB), horizon_slots=16, slot_s=1.0)
    for i in range(60):
        if p.placements() and rng.random() < 0.4:
            p.release(sorted(p.placements())[int(rng.integers(len(p.placements())))])
        else:
            p.place(job(f"j{i}", devices=int(rng.choice([1, 2]))), 0.0)
        if rng.random() < 0.7:
            ask_everything(p)
        d = p.tenancy.derived
        ask_everything(p)
        assert (d.cotenants, d.node_tenancy, d.unused.tolist()) == fresh_answers(p)


def test_questions_change_nothing_derived_but_their_own_answers():
    p = placer()
    p.place(job("a", devices=2), 0.0)
    p.place(job("b"), 0.0)
    ask_everything(p)
    d = p.tenancy.derived
    p.decide(job("c"), 1.0)
    p.room_if_moved("a")
    p.may_spread_out("b")
    assert p.tenancy.derived is d


def test_an_undone_move_rewinds_caches_and_release_count():
    """A move whose newcomer does not fit (host memory) is undone: the caches as they were
    (the same object, not a recomputed copy) and no release counted."""
    p = placer()
    for name in ("a", "b", "c", "d"):
        p.place(job(name, demand=(1,) * 8), 0.0)
    p.release("b")
    p.release("c")
    ask_everything(p)
    derived, releases = p.tenancy.derived, p.tenancy.releases
    too_big = job("too-big", devices=2, demand=(1,) * 8, host=60 * GiB)
    assert p.room_if_moved("a") >= too_big.devices  # so the move is tried, then undone
    assert p.make_room("a", too_big, 1.0) is None
    assert p.moves.room_refused == (releases, {("a", "too-big")})
    assert p.tenancy.derived is derived and p.tenancy.releases == releases
    assert np.array_equal(p.tenancy.unused(), fresh_answers(p)[2])
