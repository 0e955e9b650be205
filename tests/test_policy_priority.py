"""Request priority (docs/design.md §5) against a plain reference implementation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl.policy import Policy, ReadyQueue, StepClock, choose, offload_estimate, priorities


def queue_of(rows):
    """rows: (key, arrival, est, load_s, resident_on, nbytes)"""
    q = ReadyQueue(capacity=2)
    for seq, (key, arrival, est, load_s, resident_on, nbytes) in enumerate(rows):
        q.add(key, arrival, est, load_s, resident_on, seq, nbytes=nbytes)
    return q


def reference_choose(policy, rows, device, free_bytes, offload_bps, now, idle=()):
    best_key, best = None, None
    for seq, (key, arrival, est, load_s, resident_on, nbytes) in enumerate(rows):
        if resident_on in idle and resident_on != device:
            continue  # its own device is idle: it runs there, without moving
        if policy is Policy.FCFS:
            score = -arrival
        elif policy is Policy.SJF:
            score = -est
        else:
            service = est
            if policy is Policy.PLEXRL and resident_on != device:
                service += load_s + max(nbytes - free_bytes, 0) / offload_bps
            service = max(service, 1e-6)
            score = (max(now - arrival, 0) + service) / service
        if best is None or score > best + 1e-12 * max(1.0, abs(best)):
            best_key, best = key, score
    return best_key


CASES = {
    # name: (policy, rows, device, free, now, expected)
    "fcfs takes the earliest arrival": (Policy.FCFS, [("a", 2.0, 0.1, 0, -1, 0), ("b", 1.0, 9.0, 0, -1, 0)], 0, 0, 5.0, "b"),
    "sjf takes the shortest": (Policy.SJF, [("a", 0.0, 3.0, 0, -1, 0), ("b", 1.0, 1.0, 0, -1, 0)], 0, 0, 5.0, "b"),
    "hrrn ignores switches": (Policy.HRRN, [("a", 0.0, 1.0, 0, 0, 100), ("b", 0.0, 1.0, 5.0, -1, 100)], 0, 0, 4.0, "a"),
    "plexrl prefers the resident state": (Policy.PLEXRL, [("a", 0.0, 1.0, 2.0, -1, 100), ("b", 0.5, 1.0, 2.0, 0, 100)], 0, 1000, 2.0, "b"),
    "plexrl: waiting ages a switching request past a resident one": (
        Policy.PLEXRL, [("far", 0.0, 1.0, 1.0, -1, 100), ("near", 99.0, 1.0, 1.0, 0, 100)], 0, 1000, 100.0, "far"),
    "plexrl: resident on another device still needs a switch": (
        Policy.PLEXRL, [("a", 0.0, 1.0, 3.0, 1, 100), ("b", 0.0, 1.0, 0.0, 0, 100)], 0, 1000, 1.0, "b"),
    "plexrl: offload cost counts when the device is full": (
        Policy.PLEXRL, [("big", 0.0, 1.0, 0.1, -1, 1000), ("small", 0.0, 1.0, 0.1, -1, 10)], 0, 10, 1.0, "small"),
    "ties go to the earlier submission": (Policy.HRRN, [("first", 0.0, 1.0, 0, -1, 0), ("second", 0.0, 1.0, 0, -1, 0)], 0, 0, 1.0, "first"),
}


@pytest.mark.parametrize("name", CASES)
def test_named_cases(name):
    policy, rows, device, free, now, expected = CASES[name]
    q = queue_of(rows)
    assert choose(policy, q, device, offload_estimate(q, free, 100.0), now) == expected
    assert reference_choose(policy, rows, device, free, 100.0, now) == expected


def test_hrrn_formula_matches_design():
    q = queue_of([("a", 1.0, 2.0, 0.5, -1, 0)])
    p = priorities(Policy.PLEXRL, q, 0, offload_s=0.25, now=5.0)
    assert p[0] == pytest.approx(1 + 4.0 / (2.0 + 0.5 + 0.25))


AFFINITY_CASES = {
    # name: (rows, device, idle, expected)
    "resident on an idle device: left to it": ([("a", 0.0, 1.0, 1.0, 1, 100), ("b", 5.0, 1.0, 1.0, -1, 100)], 0, {1}, "b"),
    "resident on a busy device: taken": ([("a", 0.0, 1.0, 1.0, 1, 100), ("b", 5.0, 1.0, 1.0, -1, 100)], 0, set(), "a"),
    "only requests of an idle device: nothing": ([("a", 0.0, 1.0, 1.0, 1, 100)], 0, {0, 1}, None),
    "this device's own residents stay candidates": ([("a", 0.0, 1.0, 1.0, 0, 100)], 0, {0, 1}, "a"),
}


@pytest.mark.parametrize("name", AFFINITY_CASES)
def test_affinity_leaves_requests_to_their_idle_device(name):
    rows, device, idle, expected = AFFINITY_CASES[name]
    q = queue_of(rows)
    assert choose(Policy.FCFS, q, device, offload_estimate(q, 1000, 100.0), 10.0, idle) == expected
    assert reference_choose(Policy.FCFS, rows, device, 1000, 100.0, 10.0, idle) == expected


def test_empty_queue_chooses_nothing():
    assert choose(Policy.PLEXRL, ReadyQueue(), 0, 0.0, 0.0) is None


rows_strategy = st.lists(
    st.tuples(
        st.floats(0, 100, allow_nan=False), st.floats(0.001, 10, allow_nan=False), st.floats(0, 5, allow_nan=False),
        st.integers(-1, 2), st.integers(0, 1000),
    ),
    min_size=1, max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(rows=rows_strategy, policy=st.sampled_from(list(Policy)), device=st.integers(0, 2),
       free=st.integers(0, 1000), now=st.floats(100, 200), idle=st.sets(st.integers(0, 2)))
def test_choose_matches_reference(rows, policy, device, free, now, idle):
    keyed = [(i, *r) for i, r in enumerate(rows)]
    q = queue_of(keyed)
    got = choose(policy, q, device, offload_estimate(q, free, 100.0), now, idle)
    want = reference_choose(policy, keyed, device, free, 100.0, now, idle)
    if want is None:
        assert got is None
        return
    scores = priorities(policy, q, device, offload_estimate(q, free, 100.0), now)
    # Equal up to float ties: the chosen key must score as high as the reference's.
    assert scores[q.keys().index(got)] >= scores[q.keys().index(want)] - 1e-9 * max(1.0, abs(scores.max()))


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=80))
def test_ready_queue_matches_a_dict(ops):
    q, ref = ReadyQueue(capacity=1), {}
    for add, key in ops:
        if add and key not in ref:
            q.add(key, float(key), 1.0, 0.0, -1, key, nbytes=key)
            ref[key] = key
        elif not add and key in ref:
            q.remove(key)
            del ref[key]
    assert sorted(q.keys()) == sorted(ref)
    for slot, key in enumerate(q.keys()):
        assert q.arrival[slot] == float(ref[key]) and q.nbytes[slot] == ref[key]


SLACK_CASES = {
    # name: (policy, rows (key, arrival, est, deadline), now, expected)
    # "b" would win on response ratio (it waited longer for the same service) ...
    "without deadlines the response ratio decides": (Policy.PLEXRL, [("a", 9.0, 1.0, np.inf), ("b", 0.0, 1.0, np.inf)], 10.0, "b"),
    # ... unless "a" cannot wait another service time (1 s) without overrunning its slack
    "a request about to overrun its slack goes first": (Policy.PLEXRL, [("a", 9.0, 1.0, 10.5), ("b", 0.0, 1.0, np.inf)], 10.0, "a"),
    "slack left for more than its service time: no hurry": (Policy.PLEXRL, [("a", 9.0, 1.0, 11.5), ("b", 0.0, 1.0, np.inf)], 10.0, "b"),
    "two urgent requests: the response ratio decides between them": (
        Policy.PLEXRL, [("a", 9.0, 1.0, 10.5), ("b", 0.0, 1.0, 10.0)], 10.0, "b"),
    "only plexrl reads deadlines": (Policy.HRRN, [("a", 9.0, 1.0, 10.5), ("b", 0.0, 1.0, np.inf)], 10.0, "b"),
}


@pytest.mark.parametrize("name", SLACK_CASES)
def test_slack_cases(name):
    policy, rows, now, expected = SLACK_CASES[name]
    q = ReadyQueue(capacity=1)  # grows: the deadlines must survive it
    for seq, (key, arrival, est, deadline) in enumerate(rows):
        q.add(key, arrival, est, 0.0, 0, seq, deadline=deadline)
    assert choose(policy, q, 0, 0.0, now) == expected


def test_deadlines_move_with_their_requests_on_removal():
    q = ReadyQueue(capacity=4)
    for seq, (key, deadline) in enumerate([("a", 1.0), ("b", 2.0), ("c", 3.0)]):
        q.add(key, 0.0, 1.0, 0.0, 0, seq, deadline=deadline)
    q.remove("a")  # "c" moves into a's slot
    assert {q.key_at(i): q.deadline[i] for i in range(len(q))} == {"b": 2.0, "c": 3.0}


def test_a_step_clock_measures_the_period_from_its_boundaries_less_the_delay():
    clock = StepClock(0.5)
    assert clock.deadline(3.0) == np.inf  # never begun: no deadline
    clock.begin(0.0)
    clock.delayed(2.0)
    assert clock.deadline(3.0) == 3.0 + 0.5 * 1.0 - 2.0  # the step ran 1 s of its 3 so far
    clock.begin(10.0)  # a 10 s step that waited 2 s: 8 s alone
    assert clock.period_s == 8.0 and clock.delay_s == 0.0
    assert clock.deadline(12.0) == 12.0 + 0.5 * 8.0
    clock.delayed(1.5)  # what the step waited comes off its budget
    assert clock.deadline(12.0) == 12.0 + 4.0 - 1.5


def test_a_steps_overrun_spills_into_the_next_and_is_paid_back():
    """What a step waits beyond its budget (slack x period) counts against the next step's
    budget (the paper: "the overrun spills into later steps"), so a job whose mean slowdown is
    past its slack stays urgent; a step that waits less than its budget pays the overrun back."""
    clock = StepClock(0.1, period_s=100.0)  # a budget of 10 s a step
    clock.begin(0.0)
    clock.delayed(25.0)  # 15 s past its budget
    clock.begin(125.0)
    assert clock.delay_s == 15.0 and clock.deadline(126.0) == 126.0 + 10.0 - 15.0  # urgent from the start
    clock.delayed(2.0)  # 8 s under: the carried 15 s shrink to 7
    clock.begin(227.0)
    assert clock.delay_s == 7.0
    clock.begin(327.0)  # a step with no wait pays back the rest
    assert clock.delay_s == 0.0 and clock.deadline(328.0) == 338.0


def test_a_measured_clock_learns_the_period_from_the_steps_own_wait_only():
    clock = StepClock(0.5)
    clock.begin(0.0)
    clock.delayed(2.0)
    clock.begin(10.0)  # 8 s alone; nothing carried out of a step whose budget was unknown
    assert clock.period_s == 8.0 and clock.delay_s == 0.0
    clock.delayed(7.0)  # 3 s past its 4 s budget
    clock.begin(25.0)  # a 15 s step that itself waited 7 s: 8 s alone, not 5
    assert clock.period_s == 8.0 and clock.delay_s == 3.0
    assert StepClock.none().deadline(0.0) == np.inf


def test_a_step_clock_not_yet_measured_budgets_by_what_its_step_has_run():
    """Until a whole step is measured, the step's run so far (time since it began less its
    waits) stands for the period: a lower bound, so a job that only waits goes first at once,
    and one that ran gets slack x what it ran. A clock with no deadline would rank below every
    co-tenant past its slack for as long as they stay so (a new job starved behind them)."""
    clock = StepClock(0.1)
    clock.begin(0.0)
    clock.delayed(5.0)  # waited from the start: nothing run, no budget
    assert clock.deadline(5.0) == 0.0
    fresh = StepClock(0.1)
    fresh.begin(0.0)
    fresh.delayed(1.0)
    assert fresh.deadline(11.0) == 11.0 + 0.1 * 10.0 - 1.0  # ran 10 s of 11: 1 s of budget, all spent
    q = ReadyQueue(capacity=4)  # beside a co-tenant past its slack, the starved job goes first
    q.add("past-its-slack", 1.0, 1.0, 0.0, 0, 0, deadline=0.5)
    q.add("new", 0.0, 1.0, 0.0, 0, 1, deadline=clock.deadline(5.0))
    assert choose(Policy.PLEXRL, q, device=0, offload_s=0.0, now=6.0) == "new"
    q.remove("new")  # without a deadline, it would not
    q.add("new", 0.0, 1.0, 0.0, 0, 1, deadline=np.inf)
    assert choose(Policy.PLEXRL, q, device=0, offload_s=0.0, now=6.0) == "past-its-slack"


def test_a_job_with_infinite_slack_has_no_deadline():
    """Not inf x 0 = nan: a step that only waited, or one not yet measured, has a period of 0."""
    clock = StepClock(np.inf)
    clock.begin(0.0)
    clock.delayed(1.0)
    assert clock.deadline(1.0) == np.inf
    clock.begin(1.0)  # a step of nothing but waits: measured 0 s alone
    assert clock.period_s == 0.0 and clock.deadline(2.0) == np.inf


def test_a_step_clock_with_a_given_period_keeps_it():
    clock = StepClock(0.1, period_s=100.0)
    clock.begin(0.0)
    clock.delayed(4.0)
    assert clock.deadline(1.0) == 1.0 + 10.0 - 4.0
    clock.begin(500.0)
    assert clock.period_s == 100.0 and clock.deadline(501.0) == 511.0
    assert StepClock.none().deadline(0.0) == np.inf
