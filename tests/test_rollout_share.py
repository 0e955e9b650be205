"""`policy.share_replicas`: which replicas each elastic rollout of a group decodes on.

The invariants of its module docstring, on named cases and on random groups: shares are
disjoint and within what each rollout may use and wants; no rollout that wants more could take
a replica left over; rollouts that may use the same replicas hold as many as each other, give or
take one, unless one wants fewer; a rollout keeps the replicas it holds when it can.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plexrl.policy.rollout_share import share_replicas

EIGHT = [(d,) for d in range(8)]


@pytest.mark.parametrize("wants, usable, held, expected", [
    pytest.param([8], [EIGHT], [[]], [EIGHT], id="alone: all of them"),
    pytest.param([8, 8], [EIGHT, EIGHT], [EIGHT, []], [EIGHT[:4], EIGHT[4:]],
                 id="a newcomer gets half, the holder keeps the half it held"),
    pytest.param([2, 8], [EIGHT, EIGHT], [[(5,), (6,)], []], [[(5,), (6,)], EIGHT[:5] + [(7,)]],
                 id="a tail keeps its two replicas, the other takes the rest"),
    pytest.param([8, 8], [EIGHT[:2], EIGHT], [[], []], [EIGHT[:2], EIGHT[2:]],
                 id="the one with fewer choices gets the replicas only it may use"),
    pytest.param([8, 8], [[(0, 1), (2, 3)], EIGHT[:4]], [[], []], [[(0, 1)], [(2,), (3,)]],
                 id="a tp=2 replica and tp=1 replicas on its devices never overlap"),
    pytest.param([0, 8], [EIGHT, EIGHT], [EIGHT, []], [[], EIGHT], id="a rollout that wants none holds none"),
    pytest.param([8, 8, 8], [EIGHT] * 3, [[]] * 3, [EIGHT[:3], EIGHT[3:6], EIGHT[6:]],
                 id="three rollouts: 3, 3 and 2, the lower-numbered first"),
])
def test_named_cases(wants, usable, held, expected):
    got = share_replicas(wants, usable, held)
    assert [sorted(share) for share in got] == [sorted(e) for e in expected]


def test_one_entry_per_rollout_or_a_clear_error():
    with pytest.raises(ValueError, match="one entry per rollout, got 2, 1 and 2"):
        share_replicas([1, 1], [EIGHT], [[], []])


units = st.lists(st.integers(0, 11), min_size=1, max_size=2, unique=True).map(lambda ds: tuple(sorted(ds)))
rollout = st.tuples(st.integers(0, 6), st.lists(units, max_size=8, unique=True), st.integers(0, 3))


@settings(max_examples=300, deadline=None)
@given(st.lists(rollout, min_size=1, max_size=4))
def test_invariants_on_random_groups(rollouts):
    wants = [want for want, _, _ in rollouts]
    usable = [mine for _, mine, _ in rollouts]
    held = [mine[:keep] for _, mine, keep in rollouts]
    shares = share_replicas(wants, usable, held)
    taken = [d for share in shares for unit in share for d in unit]
    assert len(taken) == len(set(taken)), "shares never overlap on a device"
    for want, mine, share in zip(wants, usable, shares):
        assert set(share) <= set(mine) and len(share) <= want
        if len(share) < want:  # it could not take any replica left over
            assert all(set(unit) & set(taken) for unit in mine if unit not in share)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=4), st.integers(1, 12))
def test_rollouts_on_the_same_replicas_hold_as_many_give_or_take_one(wants, replicas):
    pool = [(d,) for d in range(replicas)]
    shares = share_replicas(wants, [pool] * len(wants), [[]] * len(wants))
    counts = [len(s) for s in shares]
    assert sum(counts) == min(replicas, sum(wants)), "no replica left idle that someone wants"
    for i, (want, count) in enumerate(zip(wants, counts)):
        if count < want:
            assert all(other <= count + 1 for other in counts), f"rollout {i} got {count} of {counts}"


@settings(max_examples=200, deadline=None)
@given(rollout)
def test_one_rollout_gets_what_the_rounds_would_give_it(one):
    """`share_replicas` skips the rounds for a single rollout: the same share either way."""
    from plexrl.policy.rollout_share import _keeping, _round_robin, _topped_up

    want, mine, keep = one
    held = [mine[:keep]]
    counted = _round_robin([want], [mine], held)
    kept = _keeping(counted, [mine], held)
    assert share_replicas([want], [mine], held) == (counted if kept is None else _topped_up(kept, [want], [mine]))
