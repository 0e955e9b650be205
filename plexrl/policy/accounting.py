"""Who used how much device time (docs/design.md §7).

A job is charged for the execution of its functions plus the switch-in of its states: the
offloads its dispatch forced and the load itself. Devices accumulate busy time from the same
records, so `sum(consumed_device_s) == device_busy_s` holds by construction (tested).
Durations are passed in; nothing here reads a clock.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class JobUsage:
    exec_s: float = 0.0
    exec_wall_s: float = 0.0  # wall time of the same executions (differs on emulated devices)
    switch_s: float = 0.0
    queue_wait_s: float = 0.0
    requests: int = 0
    failed: int = 0

    @property
    def consumed_device_s(self) -> float:
        return self.exec_s + self.switch_s


@dataclass
class Ledger:
    jobs: dict[str, JobUsage] = field(default_factory=lambda: defaultdict(JobUsage))
    device_busy_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    switches: int = 0
    transition_bytes: int = 0
    transition_s: float = 0.0
    transitions_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def charge_exec(self, job: str, device: int, seconds: float, wall_seconds: float | None = None) -> None:
        self.jobs[job].exec_s += seconds
        self.jobs[job].exec_wall_s += seconds if wall_seconds is None else wall_seconds
        self.device_busy_s[device] += seconds

    def charge_transition(self, job: str, device: int | None, kind: str, nbytes: int, seconds: float) -> None:
        """A transition made for `job`'s dispatch; device-side ones (load/offload) use the device."""
        self.transition_bytes += nbytes
        self.transition_s += seconds
        self.transitions_by_kind[kind] += 1
        if kind == "load":
            self.switches += 1
        if device is not None:
            self.jobs[job].switch_s += seconds
            self.device_busy_s[device] += seconds

    def record_wait(self, job: str, seconds: float) -> None:
        self.jobs[job].queue_wait_s += seconds
        self.jobs[job].requests += 1

    def record_failure(self, job: str) -> None:
        self.jobs[job].failed += 1

    def summary(self) -> dict:
        return {
            "switches": self.switches,
            "device_busy_s": sum(self.device_busy_s.values()),
            "device_busy_s_per_device": dict(sorted(self.device_busy_s.items())),
            "transition_bytes": self.transition_bytes,
            "transition_s": self.transition_s,
            "transitions": dict(self.transitions_by_kind),
            "jobs": {
                job: {
                    "consumed_device_s": u.consumed_device_s,
                    "exec_s": u.exec_s,
                    "exec_wall_s": u.exec_wall_s,
                    "switch_s": u.switch_s,
                    "queue_wait_s": u.queue_wait_s,
                    "requests": u.requests,
                    "failed": u.failed,
                }
                for job, u in sorted(self.jobs.items())
            },
        }
