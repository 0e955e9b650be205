"""Request priority: which ready request a free device runs next (docs/design.md §5).

For request i and a device whose arena holds the states `resident`:
    S_i(t) = E_i + 1[switch] * (T_offload + T_load)       effective service time
    W_i(t) = t - arrival_i                                  waiting time
    P_i(t) = (W_i + S_i) / S_i = 1 + W_i / S_i              switch-aware HRRN ("plexrl")
`hrrn` is the same without the switch term, `sjf` takes the smallest E_i, `fcfs` the earliest
arrival. Ties go to the earlier submission. Non-preemptive at function granularity.

Slack (paper, Fig. 8 text; `plexrl` only): a request may carry the time its job's slack for
the current step runs out (`ReadyQueue.add(..., deadline=...)`: its arrival plus the step's
slack in seconds less the delay already injected into the step, and the overrun earlier steps
carried in: `StepClock`, kept per job by
the simulator and by the runtime's group scheduler from the job's step marks). A request that cannot
wait another service time without overrunning it, `deadline - t <= S_i`, goes before every
request that can; among such requests the priority above decides. Without deadlines (inf,
the default) nothing changes.

Affinity: a request whose state is resident on another device that is idle right now belongs to
that device — taking it would move the state between devices (offload there, load here) to run
what its own device can start at once. `choose(..., idle=...)` leaves such requests alone.

Only the head request of each model is *ready* (calls of one model run in submission order),
so candidates are few per model; the arrays are kept in a `ReadyQueue` so a decision over a
thousand candidates is a handful of numpy operations, not a Python loop.
"""

from __future__ import annotations

from enum import Enum

import numpy as np


class Policy(str, Enum):
    FCFS = "fcfs"
    SJF = "sjf"
    HRRN = "hrrn"
    PLEXRL = "plexrl"

    @classmethod
    def parse(cls, name: "str | Policy") -> "Policy":
        try:
            return cls(name)
        except ValueError:
            raise ValueError(
                f"unknown scheduling policy {name!r}; expected one of {[p.value for p in cls]}"
            ) from None


_MIN_SERVICE_S = 1e-6  # keeps P finite for zero-cost estimates
_URGENT = 1e12  # added to the priority of a request about to overrun its job's slack


class StepClock:
    """One job's slack in its current step, what the slack term of `plexrl` ranks by (docs/design.md §5:
    "the scheduler tracks each job's injected delay against its slack"). A request of the job
    that becomes ready at `t` must start by `deadline(t)` = t + slack * period - delay, where
    `delay` is what the step's earlier calls waited plus the overrun carried in: at each step
    boundary (`begin`) the step's budget, slack * period, starts afresh, and what the step that
    ended waited beyond its budget spills into the next one (the paper's "the overrun spills into
    later steps"). So a job stays urgent while its delay summed over its steps exceeds the
    budgets summed (its mean slowdown is past its slack: the SLO), not only late in each step,
    and pays the overrun back as it runs ahead. `period_s` is the job's step time alone: given
    (the simulator: the profile's period) or measured at each boundary as the step's duration
    less what the step itself waited (the runtime). Until a measured clock has seen a whole
    step, what its current step has run so far (its time since `begin` less its waits) stands
    for the period: a lower bound of it, so the budget is never more than the step's own, and a
    job not yet measured is not left behind co-tenants that overrun theirs (with no deadline it
    would rank below every urgent request for as long as they stay urgent). A clock never begun
    has no deadline and carries nothing. Time is passed in."""

    __slots__ = ("slack", "period_s", "measured", "started_s", "delay_s", "step_delay_s")

    def __init__(self, slack: float, period_s: float | None = None):
        self.slack = slack
        self.measured = period_s is None  # the period comes from the job's own step boundaries
        self.period_s = np.inf if period_s is None else period_s
        self.started_s: float | None = None
        self.delay_s = 0.0  # against the current step's budget: its own waits and the overrun carried in
        self.step_delay_s = 0.0  # what the current step itself waited

    @classmethod
    def none(cls) -> "StepClock":
        """A job without slack tracking: no deadline ever (the baselines' jobs)."""
        return cls(0.0, np.inf)

    def begin(self, now: float) -> None:
        """A step starts at `now`; a measured clock learns the period from the step that ended,
        and what that step waited beyond its budget is carried into this one."""
        if self.measured and self.started_s is not None:
            self.period_s = max(now - self.started_s - self.step_delay_s, 0.0)
        overrun = self.delay_s - self.slack * self.period_s if self.started_s is not None else 0.0
        carried = overrun if self.period_s < np.inf and overrun > 0.0 else 0.0
        self.started_s, self.delay_s, self.step_delay_s = now, carried, 0.0

    def delayed(self, seconds: float) -> None:
        """The step's calls waited `seconds` more (queueing behind other jobs, switches)."""
        self.delay_s += seconds
        self.step_delay_s += seconds

    def deadline(self, ready_s: float) -> float:
        """When a request that became ready at `ready_s` overruns the step's slack (earlier than
        `ready_s` when the job is already past it)."""
        if self.slack == np.inf:
            return np.inf  # it tolerates any slowdown (and inf x a period of 0 is no deadline either)
        period = self.period_s
        if period == np.inf:
            if not self.measured or self.started_s is None:
                return np.inf
            period = max(ready_s - self.started_s - self.step_delay_s, 0.0)  # the step's run so far
        return ready_s + self.slack * period - self.delay_s


class ReadyQueue:
    """Struct-of-arrays over ready requests. Slot order is arbitrary; `seq` breaks ties.

    Per candidate: arrival time, estimated execution time, the device its state is resident on
    (-1 if none), the estimated time to load it (T_load) and its device bytes.
    """

    def __init__(self, capacity: int = 64):
        self._n = 0
        self._key_to_slot: dict[object, int] = {}
        self._slot_key: list[object] = []
        self.arrival = np.zeros(capacity)
        self.est = np.zeros(capacity)
        self.load_s = np.zeros(capacity)
        self.resident_on = np.full(capacity, -1, dtype=np.int64)
        self.seq = np.zeros(capacity, dtype=np.int64)
        self.nbytes = np.zeros(capacity)
        self.deadline = np.full(capacity, np.inf)  # when its job's slack for the step runs out

    def __len__(self) -> int:
        return self._n

    def __contains__(self, key: object) -> bool:
        return key in self._key_to_slot

    def keys(self) -> list[object]:
        return list(self._slot_key[: self._n])

    def add(
        self, key: object, arrival: float, est: float, load_s: float, resident_on: int, seq: int, nbytes: int = 0,
        deadline: float = np.inf,
    ) -> None:
        if key in self._key_to_slot:
            raise KeyError(f"{key!r} is already queued")
        if self._n == len(self.arrival):
            self._grow()
        i = self._n
        self.arrival[i], self.est[i], self.load_s[i] = arrival, est, load_s
        self.resident_on[i], self.seq[i], self.nbytes[i] = resident_on, seq, nbytes
        self.deadline[i] = deadline
        self._key_to_slot[key] = i
        self._slot_key.append(key) if i == len(self._slot_key) else self._slot_key.__setitem__(i, key)
        self._n += 1

    def remove(self, key: object) -> None:
        i = self._key_to_slot.pop(key)
        last = self._n - 1
        if i != last:
            for arr in (self.arrival, self.est, self.load_s, self.resident_on, self.seq, self.nbytes, self.deadline):
                arr[i] = arr[last]
            moved = self._slot_key[last]
            self._slot_key[i] = moved
            self._key_to_slot[moved] = i
        self._n -= 1

    def key_at(self, slot: int) -> object:
        return self._slot_key[slot]

    def set_resident(self, key: object, device: int) -> None:
        slot = self._key_to_slot.get(key)
        if slot is not None:
            self.resident_on[slot] = device

    def set_estimates(self, key: object, est: float | None = None, load_s: float | None = None) -> None:
        slot = self._key_to_slot[key]
        if est is not None:
            self.est[slot] = est
        if load_s is not None:
            self.load_s[slot] = load_s

    def _grow(self) -> None:
        cap = 2 * len(self.arrival)
        fill = {"resident_on": -1, "deadline": np.inf}
        for name in ("arrival", "est", "load_s", "resident_on", "seq", "nbytes", "deadline"):
            old = getattr(self, name)
            new = np.full(cap, fill.get(name, 0), dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)


def offload_estimate(queue: ReadyQueue, free_bytes: float, offload_bytes_per_s: float) -> np.ndarray:
    """T_offload per candidate: the bytes that must leave a device with `free_bytes` free."""
    n = len(queue)
    return np.maximum(queue.nbytes[:n] - free_bytes, 0.0) / offload_bytes_per_s


def priorities(
    policy: Policy, queue: ReadyQueue, device: int, offload_s: "float | np.ndarray", now: float
) -> np.ndarray:
    """Scores of every ready request for `device` (higher runs first).

    `offload_s` is the estimated T_offload of making room on `device` for a state not resident
    there: one number, or one per candidate (see `offload_estimate`).
    """
    n = len(queue)
    if policy is Policy.FCFS:
        return -queue.arrival[:n]
    est = queue.est[:n]
    if policy is Policy.SJF:
        return -est
    wait = np.maximum(now - queue.arrival[:n], 0.0)
    service = est
    if policy is Policy.PLEXRL:
        switching = queue.resident_on[:n] != device
        service = est + switching * (queue.load_s[:n] + offload_s)
        score = 1.0 + wait / np.maximum(service, _MIN_SERVICE_S)
        return score + _URGENT * (queue.deadline[:n] - now <= service)
    return 1.0 + wait / np.maximum(service, _MIN_SERVICE_S)


def choose(
    policy: Policy, queue: ReadyQueue, device: int, offload_s: "float | np.ndarray", now: float,
    idle: "frozenset[int] | set[int]" = frozenset(),
) -> object | None:
    """The key of the request `device` should run next, or None when nothing is ready for it.

    `idle`: the other devices with nothing to run now; requests resident on one of them are left
    to it (see Affinity above)."""
    n = len(queue)
    if n == 0:
        return None
    score = priorities(policy, queue, device, offload_s, now)
    others = [d for d in idle if d != device]
    if others:
        elsewhere = np.isin(queue.resident_on[:n], others)
        if elsewhere.all():
            return None
        score = np.where(elsewhere, -np.inf, score)
    best = np.flatnonzero(score == score.max())
    slot = best[0] if len(best) == 1 else best[np.argmin(queue.seq[:n][best])]
    return queue.key_at(int(slot))
