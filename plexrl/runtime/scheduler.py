"""The group scheduler: one queue for the jobs placed on a worker group (DESIGN §5).

Each model state has a FIFO of requests (calls of one model run in submission order); only its
head is *ready*. A free worker asks `next_for(device)`; the policy picks among the ready heads,
the StateManager plans and claims the transitions, and the worker runs them and the function.
Requests that need no device (save/load state, weight sync) run on the node's I/O threads as
soon as they reach the head of their FIFO.

Invariants: at most one request per model state is in flight; every submitted request is
completed or failed exactly once, also when the cluster closes (its future gets ClusterClosed).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from plexrl import errors
from plexrl.policy import LoadPlan, NoFit, Policy, ReadyQueue, Tier, choose, offload_estimate
from plexrl.api.futures import APIFuture
from plexrl.runtime.state import ModelState
from plexrl.runtime.state_manager import StateManager
from plexrl.runtime.telemetry import Telemetry

_RETRY_S = 0.002  # re-check period while every candidate waits on a state in transit


@dataclass
class Request:
    id: int
    job: str
    state_id: str
    fn: str
    run: Callable[[ModelState], Any]
    future: APIFuture
    arrival_s: float
    needs_device: bool = True
    mutates: bool = False
    seq: int = field(default=0)


class GroupScheduler:
    def __init__(
        self,
        group: int,
        devices: list[int],
        state_manager: StateManager,
        policy: Policy,
        telemetry: Telemetry,
        io_threads: int = 2,
    ):
        self.group = group
        self.devices = devices
        self.sm = state_manager
        self.policy = policy
        self.telemetry = telemetry
        self._cond = state_manager.changed
        self._fifos: dict[str, deque[Request]] = {}
        self._ready = ReadyQueue()
        self._parked: set[str] = set()  # ready heads whose state is being moved by someone else
        self._idle: set[int] = set()  # devices whose worker waits in next_for (affinity, see policy.choose)
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix=f"plexrl-io-g{group}")
        self._closed = False
        self._retiring: dict[str, Callable[[], None]] = {}

    def pending(self, state_id: str) -> int:
        return len(self._fifos.get(state_id, ()))

    # -- submission and completion -------------------------------------------------------------
    def submit(self, request: Request) -> None:
        with self._cond:
            if self._closed:
                request.future.set_exception(errors.ClusterClosed("the cluster is closed; no more calls are accepted"))
                return
            if request.state_id not in self.sm.states:
                request.future.set_exception(errors.UnknownModel(
                    f"model {request.state_id!r} no longer exists on this cluster (a retired sampler snapshot?)"))
                return
            fifo = self._fifos.setdefault(request.state_id, deque())
            fifo.append(request)
            self.telemetry.events.emit(
                request.arrival_s, "arrival", request_id=request.id, job=request.job,
                model=request.state_id, fn=request.fn, group=self.group,
            )
            if len(fifo) == 1:
                self._make_ready(request)
            self._cond.notify_all()

    def complete(self, request: Request) -> None:
        with self._cond:
            fifo = self._fifos[request.state_id]
            assert fifo[0] is request, "completed a request that was not the head of its model's queue"
            fifo.popleft()
            if fifo:
                self._make_ready(fifo[0])
            else:
                del self._fifos[request.state_id]
                self._drop_if_retired(request.state_id)
            self._cond.notify_all()

    def retire(self, state_id: str, remove) -> None:
        """Remove a state once nothing is queued for it (superseded sampler snapshots)."""
        with self._cond:
            self._retiring[state_id] = remove
            self._drop_if_retired(state_id)

    def _drop_if_retired(self, state_id: str) -> None:
        state = self.sm.states.get(state_id)
        if state_id in self._retiring and state_id not in self._fifos and state is not None and not state.busy:
            self._retiring.pop(state_id)()

    def _make_ready(self, request: Request) -> None:
        if self._closed:
            return
        if not request.needs_device:
            self._io.submit(self._run_io, request)
            return
        state = self.sm.states[request.state_id]
        self._ready.add(
            request.state_id,
            arrival=request.arrival_s,
            est=self.telemetry.estimate(request.state_id, request.fn),
            load_s=self.telemetry.transfer_seconds("load", state.device_bytes),
            resident_on=state.device if state.tier is Tier.DEVICE else -1,
            seq=request.seq,
            nbytes=state.device_bytes,
        )

    # -- dispatch ---------------------------------------------------------------------------------
    def next_for(self, device: int) -> tuple[Request, LoadPlan] | None:
        """Block until `device` has something to run; None once the cluster closes."""
        with self._cond:
            self._idle.add(device)
            try:
                while not self._closed:
                    picked = self._pick(device)
                    if picked is not None:
                        return picked
                    self._cond.wait(_RETRY_S if self._parked else None)
                return None
            finally:
                self._idle.discard(device)

    def _pick(self, device: int) -> tuple[Request, LoadPlan] | None:
        self._unpark()
        while len(self._ready):
            now = self.telemetry.now()
            free = self.sm.arenas[device].capacity_bytes - self.sm.resident_bytes(device)
            offload_s = offload_estimate(self._ready, free, self.telemetry.bytes_per_s("offload"))
            state_id = choose(self.policy, self._ready, device, offload_s, now, self._idle)
            if state_id is None:  # every ready request belongs to another idle device: wake it
                self._cond.notify_all()
                return None
            request = self._fifos[state_id][0]
            if self.sm.states[state_id].busy:
                self._park(state_id)
                continue
            plan = self.sm.prepare(state_id, device, request.job)
            if isinstance(plan, NoFit):
                if self._hopeless():
                    self._ready.remove(state_id)
                    self._fail_now(request, errors.StateTooLarge(plan.reason))
                else:
                    self._park(state_id)
                continue
            self._ready.remove(state_id)
            self._mark_residency(plan)
            return request, plan
        return None

    def _hopeless(self) -> bool:
        """Nothing in transit on the node: waiting cannot make room."""
        return not any(s.busy for s in self.sm.states.values())

    def _park(self, state_id: str) -> None:
        self._ready.remove(state_id)
        self._parked.add(state_id)

    def _unpark(self) -> None:
        for state_id in [s for s in self._parked if not self.sm.states[s].busy]:
            self._parked.discard(state_id)
            self._make_ready(self._fifos[state_id][0])

    def _mark_residency(self, plan: LoadPlan) -> None:
        """Keep the ready queue's `resident_on` right for the states this plan moves."""
        for t in plan.transitions:
            if t.state_id in self._ready:
                self._ready.set_resident(t.state_id, -1)

    def _fail_now(self, request: Request, exc: BaseException) -> None:
        self.telemetry.failed(request.job)
        self.telemetry.events.emit(
            self.telemetry.now(), "end", request_id=request.id, job=request.job, model=request.state_id,
            fn=request.fn, device=None, ok=False, error=type(exc).__name__,
        )
        request.future.set_exception(exc)
        fifo = self._fifos[request.state_id]
        fifo.popleft()
        if fifo:
            self._make_ready(fifo[0])
        else:
            del self._fifos[request.state_id]

    # -- requests that need no device ------------------------------------------------------------
    def _run_io(self, request: Request) -> None:
        with self._cond:
            while True:
                state = self.sm.states[request.state_id]
                plan = None if state.busy else self.sm.prepare(request.state_id, None, request.job)
                in_use = any(s.busy for s in self.sm.states.values())
                if self._closed or not (plan is None or (isinstance(plan, NoFit) and in_use)):
                    break
                self._cond.wait(_RETRY_S)  # the state, or the host room it needs, is in use
        if plan is None:
            plan = NoFit("the cluster closed while this call waited")
        if isinstance(plan, NoFit):
            self.telemetry.failed(request.job)
            self.complete(request)
            closed = errors.ClusterClosed("the cluster closed before this call ran")
            request.future.set_exception(closed if self._closed else errors.StateTooLarge(plan.reason))
            return
        self.telemetry.events.emit(self.telemetry.now(), "start", request_id=request.id, job=request.job,
                                   model=request.state_id, fn=request.fn, device=None)
        result, error = None, None
        try:
            state = self.sm.states[request.state_id]
            result = request.run(state)
            if request.mutates and state.tier is Tier.DEVICE:
                state.dirty = True
        except Exception as exc:  # delivered to the caller; the cluster carries on
            error = as_user_error(exc, request)
            self.telemetry.failed(request.job)
        finally:
            self.telemetry.events.emit(
                self.telemetry.now(), "end", request_id=request.id, job=request.job,
                model=request.state_id, fn=request.fn, device=None, ok=error is None,
            )
            self.sm.release(plan, self.telemetry.now())
            self.complete(request)
        if error is not None:
            request.future.set_exception(error)
        else:
            request.future.set_result(result)

    # -- shutdown ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Fail every queued request (in-flight ones finish) and wake the workers so they exit."""
        with self._cond:
            self._closed = True
            for state_id, fifo in self._fifos.items():
                in_flight = state_id not in self._ready and state_id not in self._parked
                for request in list(fifo)[1 if in_flight else 0 :]:
                    request.future.set_exception(errors.ClusterClosed("the cluster closed before this call ran"))
            self._cond.notify_all()
        self._io.shutdown(wait=True)


def as_user_error(exc: BaseException, request: Request) -> BaseException:
    if isinstance(exc, errors.PlexRLError):
        return exc
    wrapped = errors.ExecutionError(f"{request.fn} on model {request.state_id!r} failed: {type(exc).__name__}: {exc}")
    wrapped.__cause__ = exc
    return wrapped
