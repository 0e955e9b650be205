"""The step: one request run on a device (its plan's transitions first) or on the node, booked,
and resolved (node.py's dispatchers call `step`; the group scheduler's I/O threads `on_node`).

A device step sends the worker its plan's loads and offloads, the call, and the prefetch plan's
load of the state the device is likely to run next, in one message; it books what the worker
ran from its reply. Offloads the plan needs on other devices run there (`_offload_elsewhere`), and
clean copies the plan evicts are free at once (`_let_go_here`). A batched call (call_batching.py)
resolves each of its calls with its own result or error; its device time is shared among them by
tokens (each job's account is charged its calls' shares), and its `batch` event (decode steps,
live row-steps, prompt tokens, device seconds) refits the decode model.

Invariants: a request is resolved only after its end is booked and its state and queue head are
freed (a caller that sees the result also sees the node's bookkeeping done); every request is
resolved exactly once; a worker found dead fails the request retriably (worker_health.py).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import replace
from typing import Any

from plexrl.policy import LoadPlan, Tier, Transition, TransitionKind
from plexrl.runtime import functions, remote
from plexrl.runtime.device_worker import NotResident, StateSpec, WorkerReply, WorkerStep
from plexrl.runtime.host_buffers import SharedHostBuffers
from plexrl.runtime.payloads import BatchPayload
from plexrl.runtime.scheduler import GroupScheduler, Request, as_user_error
from plexrl.runtime.state import ModelState
from plexrl.runtime.state_manager import StateManager
from plexrl.runtime.telemetry import Telemetry
from plexrl.runtime.weight_sync import WeightSync
from plexrl.runtime.worker_health import WorkerHealth

log = logging.getLogger("plexrl.runtime")


def shares(result: Any, calls: int) -> list[float]:
    """Each of a device call's `calls` calls' share of its time: by tokens when its `result` is a
    batched call's (functions.BatchReply) that computed any, else equal parts."""
    total = sum(result.tokens) if isinstance(result, functions.BatchReply) else 0
    if not total:
        return [1.0 / calls] * calls
    return [tokens / total for tokens in result.tokens]


class StepRunner:
    def __init__(self, node: int, workers: dict, state_manager: StateManager, scheduler: GroupScheduler,
                 telemetry: Telemetry, buffers: SharedHostBuffers, health: WorkerHealth, weight_sync: WeightSync,
                 lock: threading.Condition):
        self.node = node
        self.workers = workers  # device index -> DeviceWorker handle
        self.sm = state_manager
        self.scheduler = scheduler
        self.telemetry = telemetry
        self.buffers = buffers
        self.health = health
        self.weight_sync = weight_sync
        self.lock = lock

    def step(self, device: int, request: Request, plan: LoadPlan, prefetch: LoadPlan | None = None) -> None:
        """Run `request` on `device` (its `plan`'s steps first) and, overlapping it, the `prefetch`
        plan's load of the state the device is likely to run next (scheduler.py)."""
        dispatched = self.telemetry.now()
        for call in request.calls:
            self.telemetry.waited(call.job, dispatched - call.arrival_s)
            self._emit(dispatched, "dispatch", call, device, switch=plan.is_switch)
        fn, payload = request.fn, request.payload
        if request.batch is not None:  # calls coalesced by the scheduler: one device call (functions.py)
            fn, payload = "sample_batch", BatchPayload([(call.fn, call.payload) for call in request.calls],
                                                       self.sm.decode_positions(request.state_id))
        result, error, timing = None, None, {}
        try:
            self.health.check_not_torn(request)  # it may have been torn while this call waited
            steps = self._offload_elsewhere(plan, request.job, device)
            worker_steps = [self._worker_step(t) for t in steps]
            plan, let_go = self._let_go_here(plan, steps)
            ahead = list(self.sm.device_steps(prefetch)) if prefetch is not None else []
            sent = self.telemetry.now()  # the worker's steps start after the offloads elsewhere
            reply: WorkerReply = remote.get(self.workers[device].run.remote(
                worker_steps, fn, payload, request.state_id, [self._worker_step(t) for t in ahead]))
            self._book(steps, reply, request, device, sent, ahead, let_go)
            timing = {"wall_s": reply.wall_s, "device_s": reply.device_s}
            result, error = reply.result, reply.error
        except Exception as exc:  # a worker found gone now, or found restarted (it lost what it held)
            died = remote.is_gone(exc) or isinstance(exc, NotResident)
            error = self.health.died(device, request, dispatched, exc) if died else exc
        if prefetch is not None:  # before the call resolves: its caller's next call may want that state
            self._release(prefetch)
            if self.sm.state(prefetch.state_id).tier is Tier.DEVICE:
                self.scheduler.prefetched(prefetch.state_id, device)
        self._finish(request, plan, device, result, error, timing)
        if self.health.restarting(device):
            self.health.await_restart(device)  # the caller knows already: it may retry on another device

    def on_node(self, request: Request, plan: LoadPlan) -> None:
        """A node function, on the host copy (the group scheduler claimed the state)."""
        started = self.telemetry.now()
        self.telemetry.waited(request.job, started - request.arrival_s)
        self._emit(started, "start", request, None)
        result, error = None, None
        try:
            self.health.check_not_torn(request)
            result = self._run_on_node(request, self.sm.state(request.state_id))
        except Exception as exc:
            error = exc
        self._finish(request, plan, None, result, error, {})

    def _release(self, plan: LoadPlan) -> None:
        """Free what `plan` claimed; a state retired meanwhile goes if nothing is queued for it."""
        self.sm.release(plan, self.telemetry.now())
        self.scheduler.released({plan.state_id, *(t.state_id for t in plan.transitions)})

    def _finish(self, request: Request, plan: LoadPlan, device: int | None, result: Any,
                error: BaseException | None, timing: dict) -> None:
        """Book the end, free the state and the queue head, then resolve: a caller that sees the
        result also sees the node's bookkeeping done. A batched call resolves each of its calls
        with its own outcome, and its timing shared out by tokens; if the device call itself
        failed, every one of them fails with it."""
        outcomes = [(result, error)]
        if request.batch is not None:
            outcomes = result.outcomes if error is None else [(None, error)] * len(request.calls)
        weights = shares(result if error is None else None, len(request.calls))
        resolved = []
        for call, (value, failure), share in zip(request.calls, outcomes, weights):
            if failure is not None:
                failure = as_user_error(getattr(failure, "cause", None) or failure, call)
                self.telemetry.failed(call.job)
            self._emit(self.telemetry.now(), "end", call, device, ok=failure is None,
                       **{key: seconds * share for key, seconds in timing.items()})
            resolved.append((call, value, failure))
        self._release(plan)
        self.scheduler.complete(request, resolved[0][2])
        for call, value, failure in resolved:
            if failure is not None:
                call.future.set_exception(failure)
            else:
                call.future.set_result(value)

    def _run_on_node(self, request: Request, state: ModelState) -> Any:
        if request.fn == "sync_weights":
            return self.weight_sync.sync(state, request.payload.name, request.payload.sampler)
        start, t0 = self.telemetry.now(), time.perf_counter()
        result = functions.execute(request.fn, state, request.payload)
        if request.fn == "save_state":
            result, written = result
            self.telemetry.transition(Transition(TransitionKind.MATERIALIZE, state.state_id, written), request.job,
                                      written, time.perf_counter() - t0, self.node, start)
        if request.function.mutates:
            self.sm.host_copy_changed(state)
            self.health.restored(state.state_id)  # its host copy is whole again
            state.unreadable = False
        return result

    def _offload_elsewhere(self, plan: LoadPlan, job: str, device: int) -> list[Transition]:
        """Have the plan's steps for other devices (the state itself resident elsewhere) run
        there; return the steps for `device`.

        The other device is usually busy (an idle one would have taken the call itself), and
        its worker runs one call at a time: a clean copy (the host copy is current, as
        write-through keeps it) is let go there without waiting, so this device loads from the
        host copy at once instead of idling until that call ends (up to ~0.3 s a switch in
        `plexrl demo`). The offload is booked when that worker answers. The node's view moves
        now; the worker's calls arrive in the order they were sent, and the plan holds the
        state until this call ends, so any later load there comes after the letting go."""
        mine = []
        for t in self.sm.device_steps(plan):
            if t.device == device:
                mine.append(t)
                continue
            start, dirty = self.telemetry.now(), self.sm.state(t.state_id).dirty
            try:
                ref = self.workers[t.device].offload.remote(t.state_id, dirty)
                if not dirty:
                    self.sm.moved(t)
                    remote.as_future(ref).add_done_callback(functools.partial(self._offloaded, t, job, start))
                    continue
                seconds = remote.get(ref)
            except Exception as exc:
                if not remote.is_gone(exc):
                    raise
                self.sm.lose_device(t.device)  # its copy is gone; the host copy is current
                continue
            self.sm.record(t, job, seconds, start, t.bytes)
        return mine

    def _let_go_here(self, plan: LoadPlan, steps: list[Transition]) -> tuple[LoadPlan, frozenset[Transition]]:
        """The clean copies `plan` evicts from its own device are free at once: (the plan that
        still claims the rest, those offloads). The worker lets go of them first thing in this
        call, but it replies only when the call ends, and another device's load reads the host
        copy (current, as write-through keeps it): a victim of a long call does not wait for it
        (a call queued for it, say, runs on an idle device now). The node's view moves now; the
        offloads are booked with the reply, as `_offload_elsewhere`'s are."""
        early = frozenset(t for t in steps if t.kind is TransitionKind.OFFLOAD and t.state_id != plan.state_id
                          and not self.sm.state(t.state_id).dirty)
        if not early:
            return plan, early
        with self.lock:
            self.sm.let_go(early)
            self.scheduler.released({t.state_id for t in early})
        return replace(plan, transitions=tuple(t for t in plan.transitions if t not in early)), early

    def _offloaded(self, t: Transition, job: str, start: float, done) -> None:
        """An offload elsewhere answered (on the thread that resolved it): book what it took. A
        worker found gone took the copy with it; its own dispatcher deals with the death."""
        try:
            seconds = done.result()
        except Exception as exc:
            if not remote.is_gone(exc):
                log.warning("letting go of %s on device %s failed: %s: %s", t.state_id, t.device,
                            type(exc).__name__, exc)
            return
        self.sm.book(t, job, seconds, start, 0)

    def _worker_step(self, t: Transition) -> WorkerStep:
        state = self.sm.state(t.state_id)
        if t.kind is TransitionKind.LOAD:
            spec = StateSpec(state.state_id, state.job, state.name, state.source, state.trainable, state.lora,
                             state.sampler, state.dtype, state.autocast)
            return WorkerStep(t.kind, t.state_id, spec, str(self.buffers.path_of(self.sm.replicas.host_of(state))),
                              t.offset, state.adam_step, weights_version=state.weights_version)
        return WorkerStep(t.kind, t.state_id, dirty=state.dirty)

    def _book(self, steps: list[Transition], reply: WorkerReply, request: Request, device: int, start: float,
              ahead: list[Transition] = (), let_go: frozenset[Transition] = frozenset()) -> None:
        """Book what the worker ran: `steps`, the call, the prefetch `ahead`. The offloads in
        `let_go` moved the node's view at dispatch (`_let_go_here`): only booked here."""
        loaded = {t.state_id for t in steps} | {request.state_id} | ({ahead[-1].state_id} if reply.prefetch_s else set())
        self.health.check_incarnation(device, reply.incarnation, loaded)
        for t, seconds in zip(steps, reply.steps_s):
            if t in let_go:
                self.sm.book(t, request.job, seconds, start, 0)
            else:
                self._record(t, request.job, seconds, start)
            start += seconds
        for call in request.calls:
            self._emit(start, "start", call, device)
        if reply.prefetch_s:
            self._book_prefetch(ahead, reply, start)
        state = self.sm.state(request.state_id)
        state.adam_step = reply.adam_step
        primary = self.sm.replicas.primary_of(request.state_id)
        for call, share in zip(request.calls, shares(reply.result, len(request.calls))):
            self.telemetry.executed(call.job, primary, call.fn, device, reply.device_s * share, reply.wall_s * share)
        if isinstance(reply.result, functions.BatchReply) and reply.result.stats is not None:  # fits the decode model
            stats = reply.result.stats
            self.telemetry.decoded(primary, stats.steps, stats.row_steps, stats.prefill_tokens, reply.device_s)
            self._emit(start, "batch", request, device, calls=len(request.calls), steps=stats.steps,
                       row_steps=stats.row_steps, prefill_tokens=stats.prefill_tokens, slots=list(stats.slots),
                       device_s=reply.device_s, wall_s=reply.wall_s)
        if request.function.mutates:  # the write-through is a host snapshot: charged like a materialization
            write = Transition(TransitionKind.MATERIALIZE, request.state_id, reply.writeback_bytes)
            self.telemetry.transition(write, request.job, reply.writeback_bytes, reply.writeback_s, self.node,
                                      self.telemetry.now(), state.device_bytes)
            self.telemetry.wrote_back(reply.writeback_bytes, reply.writeback_zeroed_bytes, reply.writeback_s)

    def _book_prefetch(self, ahead: list[Transition], reply: WorkerReply, start: float) -> None:
        """Charged to the job it was for; its load only for the part the function did not hide."""
        job = self.sm.state(ahead[-1].state_id).job
        at = start
        for t, seconds in zip(ahead, reply.prefetch_s):
            charged = reply.prefetch_exposed_s if t.kind is TransitionKind.LOAD else None
            self._record(t, job, seconds, at, charged)
            at += seconds if charged is None else charged
        self.telemetry.prefetched(ahead[-1].bytes, reply.prefetch_s[-1], reply.prefetch_exposed_s)

    def _record(self, t: Transition, job: str, seconds: float, start: float, charged_s: float | None = None) -> None:
        moved = t.bytes if t.kind is TransitionKind.LOAD or self.sm.state(t.state_id).dirty else 0
        self.sm.record(t, job, seconds, start, moved, charged_s)

    def _emit(self, t: float, event: str, request: Request, device: int | None, **extra) -> None:
        self.telemetry.events.emit(t, event, request_id=request.id, job=request.job, model=request.state_id,
                                   fn=request.fn, device=device, node=self.node, **extra)
