"""Replaying a runtime trace on one simulated node group, with the runtime's scheduling rules.

This is the mechanism of the real `GroupScheduler` + `StateManager` on virtual time, for
calibration: the runtime's `plexrl.policy.GroupQueue` for the group's devices (one FIFO per
model state, only its head is ready; calls of one model run in submission order), a free
device asks `plexrl.policy.choose` for the next call and `plexrl.policy.plan_load` for the
transitions, parks a call whose state is in flight elsewhere or cannot be fitted yet, and runs
it non-preemptively. Execution estimates and bandwidth are learned online, as in the runtime.
Only time is modelled: each call holds its device for the runtime's dispatch overhead
(`Trace.dispatch_s`), its switch and `hold_s`, a transfer takes
the run's mean time for its kind and size (`Trace.transfer_seconds`), and an offload copies
bytes only when the state is dirty.

Jobs are driven by the trace's happens-before (`trace.py`): a call arrives `gap_s` after the
last of its `after` predecessors ends in the replay.

Invariants (tested): every traced call is served exactly once; a call runs only on a state
resident on its device; resident bytes per device never exceed the budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from plexrl.policy import (BandwidthEstimator, ExecEstimator, GroupQueue, Ledger, NoFit, Policy, ResidencyView,
                           StateInfo, Tier, choose, offload_estimate, plan_load)
from plexrl.policy.types import TransitionKind
from plexrl.sim.engine import EventLoop
from plexrl.sim.trace import Trace, TracedCall, TracedStep

EXEC_PRIOR_S = 0.05  # the runtime's Telemetry priors
BANDWIDTH_PRIOR = 10e9


class _State:
    __slots__ = ("sid", "job", "device_bytes", "host_bytes", "tier", "device", "offset", "busy", "dirty", "last_used")

    def __init__(self, sid: str, job: str, device_bytes: int, host_bytes: int):
        self.sid, self.job, self.device_bytes, self.host_bytes = sid, job, device_bytes, host_bytes
        self.tier, self.device, self.offset = Tier.HOST, None, None
        self.busy, self.dirty, self.last_used = False, False, 0.0


@dataclass
class _JobProgress:
    """The happens-before frontier of one job: its calls in real end order, which are done."""

    rank: dict[int, int]  # call id -> position in the job's real end order
    done: list[bool]
    prefix_end: list[float] = field(default_factory=lambda: [0.0])  # latest replay end among ranks < k
    items: deque = field(default_factory=deque)  # (after, gap, item) in arrival order, not yet released

    @property
    def frontier(self) -> int:
        return len(self.prefix_end) - 1


@dataclass
class ReplayResult:
    call_end: dict[int, float]
    step_t: dict[tuple[str, int], float]
    ledger: Ledger
    served: int
    peak_device_bytes: int
    events: int


class GroupReplay:
    def __init__(self, trace: Trace, hold_s: dict[int, float], charge_s: dict[int, float], device_bytes: int,
                 host_bytes: int, policy: Policy = Policy.PLEXRL):
        self.trace, self.hold_s, self.charge_s, self.policy = trace, hold_s, charge_s, policy
        self.loop = EventLoop()
        self.capacity = {d: device_bytes for d in trace.devices}
        self.host_bytes = host_bytes
        self.ledger, self.estimator, self.bandwidth = Ledger(), ExecEstimator(EXEC_PRIOR_S), BandwidthEstimator(BANDWIDTH_PRIOR)
        self.states = {sid: _State(sid, job, d, h) for sid, (job, d, h) in trace.state_bytes.items()}
        self.queue: GroupQueue[tuple[TracedCall, float]] = GroupQueue()  # (call, arrival) per state
        self.seq = 0
        self.idle = set(trace.devices)
        self.unarrived: dict[str, int] = {}  # a retired state is dropped once its last call arrived and ran
        for c in trace.calls:
            self.unarrived[c.state] = self.unarrived.get(c.state, 0) + 1
        self.call_end: dict[int, float] = {}
        self.step_t: dict[tuple[str, int], float] = {}
        self.peak = 0
        self.progress = {job: self._progress(job) for job in trace.end_order}

    def _progress(self, job: str) -> _JobProgress:
        ids = self.trace.end_order[job]
        p = _JobProgress({cid: k for k, cid in enumerate(ids)}, [False] * len(ids))
        items = [(c.after, c.gap_s, c.arrival, c) for c in self.trace.calls if c.job == job]
        items += [(s.after, s.gap_s, s.t, s) for s in self.trace.steps if s.job == job]
        p.items.extend(sorted(items, key=lambda i: (i[0], i[2])))
        return p

    def run(self) -> ReplayResult:
        for job in self.progress:
            self._release(job)
        self.loop.run()
        served = len(self.call_end)
        return ReplayResult(self.call_end, self.step_t, self.ledger, served, self.peak, self.loop.events)

    # --- controllers: the happens-before frontier --------------------------------------------------
    def _release(self, job: str) -> None:
        p = self.progress[job]
        while p.items and p.items[0][0] <= p.frontier:
            after, gap, real_t, item = p.items.popleft()
            at = p.prefix_end[after] + gap if after else real_t
            self.loop.at(max(at, self.loop.now), self._arrive, item)

    def _arrive(self, item: TracedCall | TracedStep) -> None:
        if isinstance(item, TracedStep):
            self.step_t[(item.job, item.step)] = self.loop.now
            return
        self.unarrived[item.state] -= 1
        if self.unarrived[item.state] == 0 and item.state in self.trace.retired:
            self.queue.retire(item.state)
        head = self.queue.push(item.state, (item, self.loop.now))
        if head is not None:
            self._make_ready(item.state, head)
        self._dispatch_idle()

    def _ended(self, call: TracedCall) -> None:
        now = self.loop.now
        self.call_end[call.id] = now
        p = self.progress[call.job]
        p.done[p.rank[call.id]] = True
        while p.frontier < len(p.done) and p.done[p.frontier]:
            p.prefix_end.append(max(p.prefix_end[-1], self.call_end[self.trace.end_order[call.job][p.frontier]]))
        self._release(call.job)

    # --- the group scheduler -------------------------------------------------------------------------
    def _make_ready(self, sid: str, head: tuple[TracedCall, float]) -> None:
        call, arrival = head
        state = self.states[sid]
        if call.device is None:
            self.queue.start(sid)
            state.busy = True
            self.loop.at(self.loop.now + self.hold_s[call.id], self._io_done, call)
            return
        self.queue.make_ready(sid, arrival, self.estimator.estimate(sid, call.fn),
                              self.bandwidth.seconds("load", state.device_bytes),
                              state.device if state.tier is Tier.DEVICE else -1, self.seq, state.device_bytes)
        self.seq += 1

    def _dispatch_idle(self) -> None:
        for device in sorted(self.idle):
            self._pick(device)

    def _pick(self, device: int) -> bool:
        for sid, head in self.queue.unpark(lambda s: self.states[s].busy):
            self._make_ready(sid, head)
        ready = self.queue.ready
        while len(ready):
            now = self.loop.now
            free = self.capacity[device] - sum(s.device_bytes for s in self.states.values()
                                               if s.tier is Tier.DEVICE and s.device == device)
            offload_s = offload_estimate(ready, free, self.bandwidth.bytes_per_s("offload"))
            sid = choose(self.policy, ready, device, offload_s, now)
            if self.states[sid].busy:
                self.queue.park(sid)
                continue
            plan = plan_load(self._view(), sid, device)
            if isinstance(plan, NoFit):
                self.queue.park(sid)
                continue
            self._run(device, plan, self.queue.dispatch(sid))
            return True
        return False

    def _view(self) -> ResidencyView:
        infos = {
            s.sid: StateInfo(s.sid, s.job, s.device_bytes, s.host_bytes, s.tier, s.device, s.offset, s.busy,
                             self.queue.pending(s.sid), s.last_used)
            for s in self.states.values()
        }
        return ResidencyView(infos, self.capacity, self.host_bytes)

    def _run(self, device: int, plan, head: tuple[TracedCall, float]) -> None:
        """Apply the plan's transitions, charge them and the call, hold the device until it ends."""
        now = self.loop.now
        call, arrival = head
        switch_s = sum(self._move(t, call.job) for t in plan.transitions)
        state = self.states[plan.state_id]
        state.busy = True
        self.ledger.record_wait(call.job, now - arrival)
        self.ledger.charge_exec(call.job, device, self.charge_s[call.id], self.hold_s[call.id])
        self.idle.discard(device)
        resident = sum(s.device_bytes for s in self.states.values() if s.tier is Tier.DEVICE and s.device == device)
        assert resident <= self.capacity[device], f"device {device} over budget: {resident} > {self.capacity[device]}"
        self.peak = max(self.peak, resident)
        hold = self.trace.dispatch_s + switch_s + self.hold_s[call.id]
        self.loop.at(now + hold, self._device_done, (device, call))

    def _move(self, t, job: str) -> float:
        s = self.states[t.state_id]
        moved = 0
        if t.kind is TransitionKind.LOAD:
            s.tier, s.device, s.offset, s.dirty = Tier.DEVICE, t.device, t.offset, False
            moved = s.device_bytes
        elif t.kind is TransitionKind.OFFLOAD:
            moved = s.device_bytes if s.dirty else 0
            s.tier, s.device, s.offset, s.dirty = Tier.HOST, None, None, False
            self.queue.ready.set_resident(s.sid, -1)
        else:  # spill/restore: the host budget is sized so these do not happen in a replay
            raise RuntimeError(f"replay needs a {t.kind.value} of {t.state_id}; raise the host budget")
        seconds = self.trace.transfer_seconds(t.kind.value, moved)
        self.bandwidth.observe(t.kind.value, moved, seconds)
        self.ledger.charge_transition(job, t.device, t.kind.value, moved, seconds)
        return seconds

    def _device_done(self, arg: tuple[int, TracedCall]) -> None:
        device, call = arg
        self.idle.add(device)
        self.estimator.observe(call.state, call.fn, self.charge_s[call.id])
        if call.fn in self.trace.dirtying_fns:
            self.states[call.state].dirty = True
        self._finish(call)

    def _io_done(self, call: TracedCall) -> None:
        self._finish(call)

    def _finish(self, call: TracedCall) -> None:
        state = self.states[call.state]
        state.busy, state.last_used = False, self.loop.now
        head = self.queue.complete(call.state)
        if head is not None:
            self._make_ready(call.state, head)
        elif self.queue.drained(call.state):
            self.queue.take_retired(call.state)
            del self.states[call.state]
        self._ended(call)
        self._dispatch_idle()
