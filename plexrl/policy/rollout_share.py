"""Which replicas each elastic rollout of a node group decodes on (ours; the paper's small-DP
rollouts, Fig. 7c, and RLix's generation that shrinks and grows between jobs).

A rollout's responses are not dealt to its job's replicas once, at the start: the service's
router gives them to the replicas the job may use now and moves them as that changes (a moved
response re-reads its prompt and its tokens so far on its new replica). Device functions are
not preempted by it and it does not jump their queue: a rollout decodes only on replicas that
no call runs on or waits for, and holds them until its turn ends, it reaches its consolidation
cut, or the replicas are shared out again.

`share_replicas` divides those replicas among the group's rollouts, fair by count: round by
round, the rollout holding the fewest (among those that want more and have one they may use
left) takes one more, the lowest-numbered on a tie, a replica no other such rollout may use
first (a job on 8 GPUs beside one on 16 leaves the 8 to the smaller one). With those counts,
each rollout then keeps the replicas it holds (the KV cache of its responses is there) and
takes the rest from those nobody keeps; replicas still left over go to rollouts that want more.

Invariants (tests/test_rollout_share.py): the shares are disjoint; each lies within what its
rollout may use and holds at most its want; no rollout that wants more could take a replica
left over; rollouts that may use the same replicas hold as many as each other, give or take
one, unless one wants fewer. Pure: no clock, no I/O.
"""

from __future__ import annotations

from typing import Sequence

Unit = tuple[int, ...]  # one replica: the sorted ids of the devices it spans


def share_replicas(wants: Sequence[int], usable: Sequence[Sequence[Unit]],
                   held: Sequence[Sequence[Unit]]) -> list[tuple[Unit, ...]]:
    """Per rollout, the replicas it decodes on: at most `wants[i]` of `usable[i]` (the replicas
    rollout i may use now: those it holds, `held[i]`, and those nothing runs on or waits for).
    A replica is a `Unit`, the sorted device ids it spans; two units that share a device are
    never given out together (a tp=2 replica of one job and a tp=1 replica of another on one
    of its GPUs)."""
    if not len(wants) == len(usable) == len(held):
        raise ValueError(f"wants, usable and held must have one entry per rollout, got "
                         f"{len(wants)}, {len(usable)} and {len(held)}")
    if len(wants) == 1:  # what the rounds come to for one rollout, without them (the common case)
        return [_alone(wants[0], usable[0], held[0])]
    counted = _round_robin(wants, usable, held)
    kept = _keeping(counted, usable, held)
    return counted if kept is None else _topped_up(kept, wants, usable)


def _alone(want: int, usable: Sequence[Unit], held: Sequence[Unit]) -> tuple[Unit, ...]:
    """One rollout's share: the units it holds first, then the lowest, while they fit."""
    keep = set(held)
    share: list[Unit] = []
    _take(share, sorted(usable, key=lambda u: (u not in keep, u)), want, set())
    return tuple(sorted(share))


def _take(share: list[Unit], candidates, limit: int, taken: set[int]) -> None:
    """Append to `share` each of `candidates` in order that shares no device with `taken` (which
    it joins), until `share` holds `limit` units."""
    for unit in candidates:
        if len(share) < limit and taken.isdisjoint(unit):
            share.append(unit)
            taken.update(unit)


def _round_robin(wants, usable, held) -> list[tuple[Unit, ...]]:
    """How many each rollout gets, fair by count (see the module docstring), with the units
    picked on the way."""
    taken: set[int] = set()
    shares: list[list[Unit]] = [[] for _ in wants]
    keep = [frozenset(h) for h in held]
    open_ = [i for i, want in enumerate(wants) if want > 0 and usable[i]]
    while open_:
        i = min(open_, key=lambda r: (len(shares[r]), r))
        left = [u for u in usable[i] if taken.isdisjoint(u)]
        if not left:
            open_.remove(i)
            continue
        others = {d for r in open_ if r != i for u in usable[r] if taken.isdisjoint(u) for d in u}
        unit = min(left, key=lambda u: (not others.isdisjoint(u), u not in keep[i], u))
        shares[i].append(unit)
        taken.update(unit)
        if len(shares[i]) >= wants[i]:
            open_.remove(i)
    return [tuple(sorted(share)) for share in shares]


def _topped_up(shares, wants, usable) -> list[tuple[Unit, ...]]:
    """`shares` with each rollout that wants more taking units left over, in order."""
    taken = {d for share in shares for unit in share for d in unit}
    out = []
    for share, want, mine in zip(shares, wants, usable):
        share = list(share)
        _take(share, sorted(mine), want, taken)
        out.append(tuple(sorted(share)))
    return out


def _keeping(counted, usable, held) -> list[tuple[Unit, ...]] | None:
    """The same counts with each rollout keeping as many of the units it holds as its count
    allows (the round robin may hand a holder's units to a newcomer while giving the holder
    others), the rest from the units nobody keeps; None when that cannot give every rollout
    its count (units of different shapes in the way)."""
    taken: set[int] = set()
    shares: list[list[Unit]] = [[] for _ in counted]
    for i, count in enumerate(map(len, counted)):
        _take(shares[i], sorted(u for u in held[i] if u in usable[i]), count, taken)
    for i, count in enumerate(map(len, counted)):
        _take(shares[i], sorted(usable[i]), count, taken)
        if len(shares[i]) < count:
            return None
    return [tuple(sorted(share)) for share in shares]
