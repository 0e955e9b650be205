"""A GPU remembers `plan_load`'s plans by `SimWorker.plan_key` (the view with last-use times
replaced by their ranks). The memo must change nothing: a worker that plans afresh for every
switch (the reference) makes the same moves, step by step, through random sequences of
switches with ties and reorderings of last-use times and changing sets of pending states."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl.sim.worker import SimWorker

# Arena 200: two of the 100-byte states fit, so loading a third evicts one of two equal
# candidates and last use decides (the 50-byte one makes windows of other shapes).
SIZES = {"a/s": 100, "b/s": 100, "c/s": 100, "d/s": 50}


class FakeGroup:
    """The seam `SimWorker.pending` reads: which states have queued work."""

    def __init__(self):
        self.pending: set[str] = set()

    def pending_states(self, worker):
        return set(self.pending)


class FreshWorker(SimWorker):
    """The reference: its plan key never repeats, so every switch is planned afresh."""

    __slots__ = ()

    def plan_key(self, state_id, pending):
        return object()


def worker(cls):
    w = cls(wid=3, arena_bytes=200, host_bytes=10**6, link_bytes_per_s=50.0, disk_bytes_per_s=25.0)
    w.group = FakeGroup()
    for sid, n in SIZES.items():
        w.add_state(sid, sid.split("/")[0], n)
    return w


switch = st.tuples(
    st.sampled_from(sorted(SIZES)),  # the state to make resident
    st.sampled_from([0.0, 1.0, 2.0, 5.0]),  # its new last use: few values, so ties and reorders recur
    st.frozensets(st.sampled_from(sorted(SIZES)), max_size=2),  # states with queued work
)


@settings(max_examples=150, deadline=None)
@given(st.lists(switch, min_size=20, max_size=60))
def test_remembered_plans_make_the_moves_planning_afresh_makes(switches):
    memo, fresh = worker(SimWorker), worker(FreshWorker)
    for step, (sid, last_used, pending) in enumerate(switches):
        for w in (memo, fresh):
            w.states[sid].last_used = last_used
            w.group.pending = set(pending)
        got, want = memo.make_resident(sid, float(step)), fresh.make_resident(sid, float(step))
        assert got == want, step
        assert [(r.tier, r.offset) for r in memo.states.values()] == [(r.tier, r.offset) for r in fresh.states.values()]
        assert memo.used == fresh.used <= memo.arena_bytes


def test_a_recurring_residency_is_planned_once():
    w = worker(SimWorker)
    for step in range(6):  # a and b take turns: after the first round every switch is remembered
        sid = "a/s" if step % 2 == 0 else "b/s"
        w.states[sid].last_used = float(step)
        w.make_resident(sid, float(step))
    assert len(w.plans) <= 4
