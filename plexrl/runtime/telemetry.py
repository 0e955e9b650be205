"""Measurements flow through one object: the clock, the event log, the ledger, the estimates.

Components call it with what happened; it keeps the accounting consistent (every recorded
transition is in the event log and in the ledger) and thread-safe.
"""

from __future__ import annotations

import threading
import time

from plexrl.policy import BandwidthEstimator, DecodeEstimator, ExecEstimator, Ledger, Transition
from plexrl.runtime.events import EventLog


class Telemetry:
    """`epoch`: a wall-clock time (`time.time()`) to count from, so that the telemetry of several
    processes (the Ray engine's node actors) shares one time axis; default: now."""

    def __init__(self, events: EventLog, bandwidth_prior: float = 10e9, exec_prior_s: float = 0.05,
                 epoch: float | None = None):
        self.events = events
        self.ledger = Ledger()
        self.bandwidth = BandwidthEstimator(bandwidth_prior)
        self.exec_estimates = ExecEstimator(exec_prior_s)
        self.decode_estimates = DecodeEstimator()  # per model, from its batched sample calls
        self.writeback = {"writebacks": 0, "writeback_bytes": 0, "writeback_zeroed_bytes": 0, "writeback_s": 0.0}
        self.prefetch = {"prefetches": 0, "prefetch_bytes": 0, "prefetch_s": 0.0, "prefetch_exposed_s": 0.0}
        self._lock = threading.Lock()
        self.epoch = time.time() if epoch is None else epoch
        self._t0 = time.perf_counter() - (time.time() - self.epoch)

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def transition(self, t: Transition, job: str, moved_bytes: int, seconds: float, node: int, start: float,
                   state_bytes: int = 0, charged_s: float | None = None) -> None:
        """`seconds` the transition took; `charged_s` (default: all of them) the part it held its
        device: a prefetched load overlaps a function, which the device's time already counts."""
        device_side = t.device if t.kind.value in ("load", "offload") else None
        charged = seconds if charged_s is None else charged_s
        with self._lock:
            self.ledger.charge_transition(job, device_side, t.kind.value, moved_bytes, charged)
            self.bandwidth.observe(t.kind.value, moved_bytes, seconds)
        extra = {} if charged_s is None else {"hidden_s": seconds - charged}
        self.events.emit(
            start, "transition", kind=t.kind.value, state=t.state_id, job=job, device=t.device,
            node=node, bytes=moved_bytes, seconds=seconds, state_bytes=state_bytes, **extra,
        )

    def executed(self, job: str, model: str, fn: str, device: int | None, seconds: float,
                 wall_seconds: float | None = None) -> None:
        with self._lock:
            if device is not None:
                self.ledger.charge_exec(job, device, seconds, wall_seconds)
            self.exec_estimates.observe(model, fn, seconds)

    def decoded(self, model: str, steps: int, row_steps: int, prompt_tokens: int, seconds: float) -> None:
        """A batched sample call of `model` ran: its figures refit the model's decode model."""
        with self._lock:
            self.decode_estimates.observe(model, steps, row_steps, prompt_tokens, seconds)

    def wrote_back(self, copied_bytes: int, zeroed_bytes: int, seconds: float) -> None:
        """A write-through (device_worker.py): bytes copied from the arena, bytes zeroed on the host copy."""
        with self._lock:
            for key, value in (("writebacks", 1), ("writeback_bytes", copied_bytes),
                               ("writeback_zeroed_bytes", zeroed_bytes), ("writeback_s", seconds)):
                self.writeback[key] += value

    def prefetched(self, nbytes: int, seconds: float, exposed_s: float) -> None:
        """A load that overlapped a function (device_worker.py): its copy time and the part not hidden."""
        with self._lock:
            for key, value in (("prefetches", 1), ("prefetch_bytes", nbytes), ("prefetch_s", seconds),
                               ("prefetch_exposed_s", exposed_s)):
                self.prefetch[key] += value

    def waited(self, job: str, seconds: float) -> None:
        with self._lock:
            self.ledger.record_wait(job, seconds)

    def failed(self, job: str) -> None:
        with self._lock:
            self.ledger.record_failure(job)

    def decode_estimate(self, model: str, rows, slots: int) -> float | None:
        """Seconds of a batched call of `rows` (num_samples, prompt tokens, max_tokens) of `model`
        (policy.DecodeModel fitted to its calls), or None before it has enough of them."""
        with self._lock:
            return self.decode_estimates.estimate(model, rows, slots)

    def estimate(self, model: str, fn: str) -> float:
        with self._lock:
            return self.exec_estimates.estimate(model, fn)

    def transfer_seconds(self, kind: str, nbytes: int) -> float:
        with self._lock:
            return self.bandwidth.seconds(kind, nbytes)

    def bytes_per_s(self, kind: str) -> float:
        with self._lock:
            return self.bandwidth.bytes_per_s(kind)

    def summary(self) -> dict:
        with self._lock:
            out = self.ledger.summary()
            out.update(self.writeback)
            out.update(self.prefetch)
            out["bandwidth_gbps"] = {k: self.bandwidth.bytes_per_s(k) / 1e9 for k in ("load", "offload", "spill", "restore")}
        out.update(self.events.activity_summary())
        return out
