"""A worker: one device, one thread. Its loop is the whole story:
ask the group scheduler for the next request, make its state resident, run the function.
"""

from __future__ import annotations

import threading
import time

import torch

from plexrl.policy import Tier
from plexrl.runtime.scheduler import GroupScheduler, Request, as_user_error
from plexrl.runtime.state_manager import StateManager
from plexrl.runtime.telemetry import Telemetry


class Worker:
    def __init__(self, device: int, scheduler: GroupScheduler, state_manager: StateManager,
                 telemetry: Telemetry, threads: int = 1):
        self.device = device
        self.scheduler = scheduler
        self.sm = state_manager
        self.telemetry = telemetry
        self.threads = threads
        self.current: str | None = None  # the model running now, for progress displays
        self._thread = threading.Thread(target=self._loop, name=f"plexrl-worker-{device}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _loop(self) -> None:
        # Per-device intra-op threads: results are bitwise reproducible for a fixed count.
        torch.set_num_threads(self.threads)
        while (item := self.scheduler.next_for(self.device)) is not None:
            self.step(*item)

    def step(self, request: Request, plan) -> None:
        dispatched = self.telemetry.now()
        self.telemetry.waited(request.job, dispatched - request.arrival_s)
        self._emit(dispatched, "dispatch", request, switch=plan.is_switch)
        self.current = request.state_id
        result, error = None, None
        try:
            self.sm.apply(plan, request.job)
            state = self.sm.states[request.state_id]
            assert state.tier is Tier.DEVICE and state.device == self.device, "executing a state that is not resident here"
            self._emit(self.telemetry.now(), "start", request)
            t0 = time.perf_counter()
            result = request.run(state)
            if request.mutates:
                state.dirty = True
            self.telemetry.executed(request.job, request.state_id, request.fn, self.device, time.perf_counter() - t0)
        except Exception as exc:  # the caller gets it; the worker and other jobs carry on
            error = as_user_error(exc, request)
            self.telemetry.failed(request.job)
        finally:
            self.current = None
            self._emit(self.telemetry.now(), "end", request, ok=error is None)
            self.sm.release(plan, self.telemetry.now())
            self.scheduler.complete(request)
        # Resolved last: a caller that sees the result also sees the cluster's bookkeeping done.
        if error is not None:
            request.future.set_exception(error)
        else:
            request.future.set_result(result)

    def _emit(self, t: float, event: str, request: Request, **extra) -> None:
        self.telemetry.events.emit(
            t, event, request_id=request.id, job=request.job, model=request.state_id,
            fn=request.fn, device=self.device, **extra,
        )
