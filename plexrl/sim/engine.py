"""The discrete-event loop: a heap of (time, sequence, handler, argument) on virtual time.

Events at equal times run in the order they were scheduled (the sequence number breaks
ties), which makes a run a pure function of its inputs. `events` counts the simulated
occurrences processed: every handler run, plus those a handler processed on behalf of events
it stands for (`count`: the call ends of a phase that the service ends together, each with its
own reserved sequence number so everything else is ordered as if they had been scheduled).
"""

from __future__ import annotations

import gc
import heapq
from typing import Any, Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0

    def at(self, time: float, handler: Callable[[Any], None], arg: Any = None) -> None:
        if time < self.now:
            raise ValueError(f"cannot schedule an event at t={time} before now={self.now}")
        heapq.heappush(self._heap, (time, self._seq, handler, arg))
        self._seq += 1

    def reserve(self, n: int = 1) -> int:
        """Take the `n` sequence numbers the next `n` calls of `at` would take, for `at_reserved`;
        returns the first."""
        self._seq += n
        return self._seq - n

    def at_reserved(self, time: float, seq: int, handler: Callable[[Any], None], arg: Any = None) -> None:
        """Schedule an event under a sequence number taken earlier with `reserve`."""
        self.at_all_reserved([(time, seq, handler, arg)])

    def at_all_reserved(self, entries: list[tuple[float, int, Callable[[Any], None], Any]]) -> None:
        """`at_reserved` for each (time, sequence number, handler, argument) of `entries`."""
        heap, now, push = self._heap, self.now, heapq.heappush
        for entry in entries:
            if entry[0] < now:
                raise ValueError(f"cannot schedule an event at t={entry[0]} before now={now}")
            push(heap, entry)

    def count(self, n: int) -> None:
        """`n` more occurrences processed by the running handler on behalf of other events."""
        self.events += n

    def run(self, until: float = float("inf")) -> None:
        """Run events in order up to `until`. The cyclic garbage collector is paused meanwhile:
        a run allocates millions of short-lived tuples, and every collection they trigger would
        walk the simulation's live objects (about a tenth of a run's time on scale-1024); the
        cycles a run leaves behind (its jobs and GPUs) are collected after it."""
        heap, pop, events = self._heap, heapq.heappop, 0
        collecting = gc.isenabled()
        gc.disable()
        try:
            while heap and heap[0][0] <= until:
                time, _, handler, arg = pop(heap)
                self.now = time
                events += 1
                handler(arg)
        finally:  # counted locally: one attribute write per event saved
            self.events += events
            if collecting:
                gc.enable()

    def pending(self) -> int:
        return len(self._heap)
