"""runtime/call_order.py: each (front, model) pair's calls are submitted once each, in seq order,
whatever order they arrive in; pairs do not wait on each other."""

import pytest

from plexrl.runtime.call_order import CallOrder

CASES = {
    "in order": [(0, "m", 0), (0, "m", 1), (0, "m", 2)],
    "reversed": [(0, "m", 2), (0, "m", 1), (0, "m", 0)],
    "two fronts interleaved": [(1, "m", 1), (0, "m", 0), (1, "m", 0), (0, "m", 1)],
    "two models, one late": [(0, "a", 1), (0, "b", 0), (0, "a", 0), (0, "b", 1)],
}


@pytest.mark.parametrize("arrivals", CASES.values(), ids=CASES.keys())
def test_each_pair_is_submitted_once_each_in_seq_order(arrivals):
    submitted = []
    order = CallOrder(submitted.append)
    for caller, model, seq in arrivals:
        order.arrive(caller, model, seq, (caller, model, seq))
    assert sorted(submitted) == sorted(arrivals)
    for pair in {(c, m) for c, m, _ in arrivals}:
        assert [s for c, m, s in submitted if (c, m) == pair] == sorted(s for c, m, s in arrivals if (c, m) == pair)


def test_a_call_that_overtook_an_earlier_one_waits_for_it():
    submitted = []
    order = CallOrder(submitted.append)
    order.arrive(0, "m", 1, "second")
    assert submitted == []
    order.arrive(0, "m", 0, "first")
    assert submitted == ["first", "second"]
