"""A worker: one device, one thread. Its loop is the whole story:
ask the group scheduler for the next request, make its state resident, run the function.

How long a function held the device: on a CUDA device, wall time. On a logical CPU device the
"device" is emulated on cores shared with every controller and other worker of the process, so
wall time would charge a job for interpreter-lock waits and other threads' CPU that a real
device never sees; there the charge is the CPU time of the worker thread (which runs every op
itself at one intra-op thread per device). Both are in the event log (`wall_s`, `device_s`).
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
                 telemetry: Telemetry, threads: int = 1, timing: str = "thread_cpu"):
        self.device = device
        self.timing = timing  # "wall" on CUDA devices, "thread_cpu" on logical CPU devices
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
        result, error, timing = None, None, {}
        try:
            self.sm.apply(plan, request.job)
            state = self.sm.states[request.state_id]
            assert state.tier is Tier.DEVICE and state.device == self.device, "executing a state that is not resident here"
            self._emit(self.telemetry.now(), "start", request)
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            result = request.run(state)
            if request.mutates:
                state.dirty = True
            wall_s = time.perf_counter() - wall0
            device_s = wall_s if self.timing == "wall" else time.thread_time() - cpu0
            timing = {"wall_s": wall_s, "device_s": device_s}
            self.telemetry.executed(request.job, request.state_id, request.fn, self.device, device_s, wall_s)
        except Exception as exc:  # the caller gets it; the worker and other jobs carry on
            error = as_user_error(exc, request)
            self.telemetry.failed(request.job)
        finally:
            self.current = None
            self._emit(self.telemetry.now(), "end", request, ok=error is None, **timing)
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
