"""Call order on a node: the calls of one model from one front enter the group's queue in the
order the front numbered them (`Call.seq`), whatever order the transport delivers them in.

Invariants: each (front, model) pair's calls are submitted exactly once each, in seq order with
none skipped; a call that overtook an earlier one waits here until that one arrives;
submissions happen under this object's own lock, so two threads delivering calls of one pair
cannot submit them out of order.
"""

from __future__ import annotations

import threading
from typing import Callable

from plexrl.runtime.scheduler import Request


class CallOrder:
    def __init__(self, submit: Callable[[Request], None]):
        """`submit(request)`: hand a call that is next in its sequence on (to the node's queue)."""
        self._submit = submit
        self._arrivals = threading.Lock()  # not the node's lock, which `submit` takes inside it
        self._next_seq: dict[tuple[int, str], int] = {}
        self._early: dict[tuple[int, str], dict[int, Request]] = {}  # calls that overtook earlier ones

    def arrive(self, caller: int, state_id: str, seq: int, request: Request) -> None:
        """Call number `seq` of `state_id` from front `caller` arrived: submit it and every call
        of that pair it unblocks, or keep it until the calls before it arrive."""
        key = (caller, state_id)
        with self._arrivals:
            early = self._early.setdefault(key, {})
            early[seq] = request
            expected = self._next_seq.get(key, 0)
            while expected in early:
                self._submit(early.pop(expected))
                expected += 1
            self._next_seq[key] = expected
