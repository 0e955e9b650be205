"""The request queues of one node group: per-state FIFOs, ready heads, parking (docs/design.md §5).

The runtime's `GroupScheduler` (which adds threads, a lock and the I/O pool) and the simulator's
`GroupReplay` (virtual time) keep their queues here, so both follow one set of rules. Items are
opaque (a `Request`, a traced call); states are named by their id.

Each state has a FIFO of items in push order and only its head can run. The head is in one of
the `Head` phases:
- PENDING: it has just become the head; the caller decides what it is. Every method that makes a
  new head (`push`, `complete`, `fail`, `unpark`) returns it, and the caller then calls either
  `make_ready` with the figures the policy ranks it by (arrival, estimates, residency, `seq`:
  the caller's, time included) or `start` for an item that needs no device (the runtime runs
  those on its I/O threads as soon as they reach the head);
- READY: a candidate in `ready`, the `ReadyQueue` that `plexrl.policy.choose` reads (keyed by
  state id); `dispatch` takes it, `park` sets it aside;
- PARKED: chosen while its state was busy or could not be fitted; out of `ready` until `unpark`
  finds its state free again and hands it back as PENDING (with fresh figures from the caller);
- RUNNING: dispatched to a device or started off-device, until `complete` or `fail`.
A state marked by `retire` is reported `drained` once nothing is queued for it.
`take_next` hands the item right behind a head to the caller, who queues it on another state
(the runtime's read replicas: calls of a weights-only state that may run side by side).

Invariants (tests/test_policy_group_queue.py): the items of one state leave in push order (or
are taken, by `take_next`, from right behind the head); at
most one head per state is RUNNING and only a head is ever READY, PARKED or RUNNING; `ready`
holds exactly the READY heads; every pushed item leaves exactly once (by `complete` or `fail`);
`items()` lists every queued item exactly once, RUNNING heads marked in flight.
"""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import Callable, Generic, TypeVar

import numpy as np

from plexrl.policy.priority import ReadyQueue

T = TypeVar("T")


class Head(str, Enum):
    PENDING = "pending"
    READY = "ready"
    PARKED = "parked"
    RUNNING = "running"


class GroupQueue(Generic[T]):
    def __init__(self) -> None:
        self.ready = ReadyQueue()
        self._fifos: dict[str, deque[T]] = {}
        self._head: dict[str, Head] = {}  # phase of each non-empty FIFO's head
        self._parked: dict[str, None] = {}  # PARKED heads in parking order (un-parked in that order)
        self._retiring: dict[str, object] = {}

    def __len__(self) -> int:
        return sum(len(f) for f in self._fifos.values())

    def pending(self, state_id: str) -> int:
        """Items queued for `state_id`, its head included."""
        return len(self._fifos.get(state_id, ()))

    def head(self, state_id: str) -> T | None:
        fifo = self._fifos.get(state_id)
        return fifo[0] if fifo else None

    def next(self, state_id: str) -> T | None:
        """The item right behind the head, or None."""
        fifo = self._fifos.get(state_id)
        return fifo[1] if fifo is not None and len(fifo) > 1 else None

    def queued(self, state_id: str) -> list[T]:
        """The state's items in push order, its head first."""
        return list(self._fifos.get(state_id, ()))

    def phase(self, state_id: str) -> Head | None:
        return self._head.get(state_id)

    def parked(self) -> list[str]:
        return list(self._parked)

    # -- a head's phases ---------------------------------------------------------------------------
    def push(self, state_id: str, item: T) -> T | None:
        """Queue `item` behind the state's earlier items; returns it if it is now the (PENDING) head."""
        fifo = self._fifos.setdefault(state_id, deque())
        fifo.append(item)
        if len(fifo) > 1:
            return None
        self._head[state_id] = Head.PENDING
        return item

    def make_ready(self, state_id: str, arrival: float, est: float, load_s: float, resident_on: int, seq: int,
                   nbytes: int = 0, deadline: float = np.inf) -> None:
        """PENDING -> READY: the head becomes a candidate for `choose` with these figures
        (`deadline`: when its job's slack for the step runs out, `StepClock.deadline`)."""
        self._move(state_id, Head.PENDING, Head.READY)
        self.ready.add(state_id, arrival, est, load_s, resident_on, seq, nbytes, deadline)

    def start(self, state_id: str) -> T:
        """PENDING -> RUNNING without a device (the caller runs it now); returns the head."""
        self._move(state_id, Head.PENDING, Head.RUNNING)
        return self._fifos[state_id][0]

    def dispatch(self, state_id: str) -> T:
        """READY -> RUNNING: a device takes the head; returns it."""
        self._move(state_id, Head.READY, Head.RUNNING)
        self.ready.remove(state_id)
        return self._fifos[state_id][0]

    def park(self, state_id: str) -> None:
        """READY -> PARKED: the head waits out of `ready` until its state is free."""
        self._move(state_id, Head.READY, Head.PARKED)
        self.ready.remove(state_id)
        self._parked[state_id] = None

    def unpark(self, busy: Callable[[str], bool]) -> list[tuple[str, T]]:
        """PARKED -> PENDING for every parked head whose state is not `busy`, in parking order."""
        freed = [s for s in self._parked if not busy(s)]
        for state_id in freed:
            del self._parked[state_id]
            self._head[state_id] = Head.PENDING
        return [(s, self._fifos[s][0]) for s in freed]

    def take_next(self, state_id: str) -> T:
        """Remove and return the item right behind the head (the caller queues it elsewhere)."""
        fifo = self._fifos.get(state_id)
        if fifo is None or len(fifo) < 2:
            raise RuntimeError(f"{state_id!r} has no item behind its head")
        item = fifo[1]
        del fifo[1]
        return item

    def complete(self, state_id: str) -> T | None:
        """The RUNNING head leaves; returns the next head (PENDING) or None."""
        self._expect(state_id, Head.RUNNING)
        return self._pop(state_id)

    def fail(self, state_id: str) -> T | None:
        """The head leaves from any phase (the caller fails it); returns the next head or None."""
        phase = self._head[state_id]
        if phase is Head.READY:
            self.ready.remove(state_id)
        elif phase is Head.PARKED:
            del self._parked[state_id]
        return self._pop(state_id)

    def _pop(self, state_id: str) -> T | None:
        fifo = self._fifos[state_id]
        fifo.popleft()
        if fifo:
            self._head[state_id] = Head.PENDING
            return fifo[0]
        del self._fifos[state_id], self._head[state_id]
        return None

    def _move(self, state_id: str, expected: Head, to: Head) -> None:
        self._expect(state_id, expected)
        self._head[state_id] = to

    def _expect(self, state_id: str, expected: Head) -> None:
        phase = self._head.get(state_id)
        if phase is not expected:
            raise RuntimeError(f"the head of {state_id!r} is {phase and phase.value}, expected {expected.value}")

    # -- retirement and close ----------------------------------------------------------------------
    def retire(self, state_id: str, token: object = None) -> None:
        """Mark `state_id` to be removed once nothing is queued for it; `token` comes back from `take_retired`."""
        self._retiring[state_id] = token

    def drained(self, state_id: str) -> bool:
        """Marked by `retire` and nothing queued (the caller may still wait for the state itself)."""
        return state_id in self._retiring and state_id not in self._fifos

    def take_retired(self, state_id: str) -> object:
        """Unmark a state the caller now removes; returns its `retire` token."""
        return self._retiring.pop(state_id)

    def items(self) -> list[tuple[str, T, bool]]:
        """Every queued item once, as (state id, item, in flight), in push order per state.

        A list, so the caller may fail them (and their callbacks push) while it walks it."""
        return [(state_id, item, k == 0 and self._head[state_id] is Head.RUNNING)
                for state_id, fifo in self._fifos.items() for k, item in enumerate(fifo)]
