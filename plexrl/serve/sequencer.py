"""Ordering of one model's calls: the Tinker SDK numbers each training client's calls (`seq_id`,
from 1) and sends them concurrently (the chunks of one forward_backward in parallel, the first
chunk last), so the server must run them in number order, not arrival order.

Invariants:
- calls run in `seq_id` order, once the model exists (`open`), each exactly once;
- a call numbered below the next expected one (unnumbered, or arriving after its gap was
  skipped) runs at once;
- a missing number is waited for at most `gap_s` (a number the SDK reserved and never sent
  must not stall the model forever); `drain` (called on arrivals and by the service's reaper)
  then goes on with the lowest number held;
- a number more than `window` ahead of the next expected one is refused (`check`), naming the
  one expected: no client has that many calls of one model in flight, and holding it would make
  every later call wait out the gap.

Pure: time comes from the `clock` it is given.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from plexrl.api import errors

log = logging.getLogger("plexrl.serve")


class Sequencer:
    """Runs one model's submissions in seq_id order, once the model exists."""

    def __init__(self, next_seq: int, gap_s: float, clock: Callable[[], float], window: int = 1024):
        self.next_seq = next_seq
        self.gap_s = gap_s
        self.window = window
        self.clock = clock
        self.ready = False
        self.held: dict[int, Callable[[], None]] = {}  # numbered calls not run yet
        self.late: list[Callable[[], None]] = []  # unnumbered or late calls, until the model exists
        self._blocked_since: float | None = None  # since when calls are held waiting for next_seq
        self._lock = threading.RLock()

    def check(self, seq: int | None) -> None:
        """InvalidInput when `seq` is further ahead of the next expected number than `window`."""
        with self._lock:
            if seq is not None and seq >= self.next_seq + self.window:
                raise errors.InvalidInput(
                    f"seq_id={seq}; this model's next call is seq_id={self.next_seq}, and a call may be at most "
                    f"{self.window - 1} ahead of it (expected a seq_id below {self.next_seq + self.window})")

    def arrive(self, seq: int | None, start: Callable[[], None]) -> None:
        with self._lock:
            if seq is None or seq < self.next_seq or seq in self.held:
                self.late.append(start)
            else:
                self.held[seq] = start
            self.drain()

    def open(self) -> None:
        with self._lock:
            self.ready = True
            self.drain()

    def drain(self) -> None:
        with self._lock:
            if not self.ready:
                return
            while self.late:
                self.late.pop(0)()
            if self.held and self.next_seq not in self.held:
                now = self.clock()
                if self._blocked_since is None:
                    self._blocked_since = now
                elif now - self._blocked_since > self.gap_s:
                    log.warning("seq_id %d never arrived in %.0f s; going on with %d", self.next_seq, self.gap_s,
                                min(self.held))
                    self.next_seq = min(self.held)
            while self.next_seq in self.held:
                start = self.held.pop(self.next_seq)
                self.next_seq += 1
                self._blocked_since = None
                start()
            if self.held and self._blocked_since is None:
                self._blocked_since = self.clock()

    def waiting_for(self, seq: int | None) -> str | None:
        with self._lock:
            if not self.ready:
                return "the model is being placed and loaded (waiting for room on the cluster)"
            if seq is not None and seq in self.held:
                return f"waiting for request seq_id={self.next_seq} of this model (a model's requests run in order)"
            return None
