"""One node: its StateManager, its group scheduler, and a dispatcher per device (docs/design.md §2, §8).

    Node (one per node group; hosted in the driver, in a thread pool, or as a Ray actor)
      ├ StateManager   residency, budgets, host buffers in shared memory, spill files
      ├ GroupScheduler the policy picks, plans and claims
      └ a dispatcher thread per device: next request -> DeviceWorker.run(steps, fn, payload)

The node owns residency and every host copy; a DeviceWorker owns only its arena. Node functions
(functions.Where.NODE: checkpoints, weight sync, reading weights) run here on the host copy,
which write-through keeps current. When a worker dies, its in-flight request fails with
errors.WorkerFailed (retriable: nothing is retried behind the caller's back, because only the
caller knows whether repeating it is right), every state that was resident on the device falls
back to its host copy, the host restarts the worker, and the next request loads them again.

LoRA states (runtime/lora.py): the node keeps one frozen base module per source (`_bases`), on
which every LoRA state of that source and its sampler snapshots build their modules; their host
copies hold only their adapters. The StateManager counts each base once (state_manager.py).

The device budget (state_manager.py) keeps each base model's activation reserve, which the
workers measure when its first model is added here (or `activation_reserve_bytes` when set by
hand), and its vLLM engine's share beside the states. When what is kept beside them grows (a new
model, a first vLLM snapshot), `_fit_arenas` holds the devices between calls, drops their device
copies and has the workers let their arenas go, to be allocated at the smaller size. Arenas grow
back only when a model is next added (removing one never waits for the devices).

A batched call (scheduler.py `_coalesce`: a state's queued sample and compute_logprobs calls in
one device call) resolves each of its calls with its own result or error; its device time is
shared among them by tokens (each job's account is charged its calls' shares), and its `batch`
event (decode steps, live row-steps, prompt tokens, device seconds) refits the decode model.

Calls arrive as `Call`s numbered per (front, model); they enter the group's queue in that order
whatever order the transport delivers them in (calls of one model from one front run in order).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from plexrl.api import errors
from plexrl.api.cluster import StateHandle
from plexrl.api.futures import APIFuture
from plexrl.api.types import LoraConfig
from plexrl.policy import LoadPlan, Policy, Tier, Transition, TransitionKind
from plexrl.runtime import activation, functions, lora, precision, remote
from plexrl.runtime.arena import DeviceArena
from plexrl.runtime.device_worker import NotResident, StateSpec, WorkerReply, WorkerStep
from plexrl.runtime.events import EventLog
from plexrl.runtime.host_buffers import SharedHostBuffers, sweep_stale
from plexrl.runtime.payloads import BatchPayload
from plexrl.runtime.scheduler import GroupScheduler, Request, as_user_error
from plexrl.runtime.state import FLOAT_BYTES, ModelState, load_module, skeleton_like
from plexrl.runtime.state_manager import StateManager
from plexrl.runtime.telemetry import Telemetry
from plexrl.samplers.vllm_sampler import check_vllm_state

log = logging.getLogger("plexrl.runtime")

RESTART_TIMEOUT_S = 300.0
SUPERSEDED_KEPT = 1024  # retired snapshots a late call may still name (it races its sync by milliseconds)
RESTART_POLL_S = 0.05


@dataclass(frozen=True)
class Call:
    """One call as it crosses from a front to a node: never a closure, never model state."""

    request_id: int
    job: str
    state_id: str
    fn: str
    payload: Any  # the function's payload type (runtime/payloads.py), decoded by the front
    caller: int  # the front's number
    seq: int  # the call's number among the front's calls of this model


@dataclass(frozen=True)
class Synced:
    """A weight sync's outcome: the snapshot now holding the trainer's weights under `name`."""

    snapshot: StateHandle
    name: str


def shares(result: Any, calls: int) -> list[float]:
    """Each of a device call's `calls` calls' share of its time: by tokens when its `result` is a
    batched call's (functions.BatchReply) that computed any, else equal parts."""
    total = sum(result.tokens) if isinstance(result, functions.BatchReply) else 0
    if not total:
        return [1.0 / calls] * calls
    return [tokens / total for tokens in result.tokens]


class Node:
    def __init__(self, node: int, devices: list[int], workers: dict, device_memory_bytes: int,
                 host_memory_bytes: int, policy: str, workdir: str, shm_folder: str, epoch: float,
                 event_log: str | None = None, prefetch: bool = True, precision: str = "fp32",
                 activation_reserve_bytes: int | None = None, activation_probe_tokens: int | None = None,
                 events_kept: int | None = None, read_replicas: bool = True):
        """`precision`: "fp32" or "bf16", or "auto" when the front could not tell what the workers
        run on (Ray): the first state's making asks them (runtime/precision.py).
        `activation_reserve_bytes`: every model's reserve (None: the workers measure it on a batch of
        `activation_probe_tokens` tokens, runtime/activation.py)."""
        self.node = node
        self._reserve_by_hand, self._probe_tokens = activation_reserve_bytes, activation_probe_tokens
        self.precision = precision
        self.workers = workers  # device index -> DeviceWorker handle
        import transformers.models.auto.modeling_auto  # noqa: F401  (see DeviceWorker.__init__)
        self.telemetry = Telemetry(EventLog(event_log, events_kept), epoch=epoch)  # the front's time axis
        arenas = {d: DeviceArena(d, device_memory_bytes) for d in devices}  # budgets only: never allocated here
        sweep_stale()  # what dead drivers left on this machine
        self.buffers = SharedHostBuffers(shm_folder)
        self.writeback = self.buffers.flags(max(devices) + 1)  # set while a worker writes a host copy back
        self._torn: set[str] = set()  # states whose host copy a dying worker left half written
        self.changed = threading.Condition(threading.RLock())  # the node's one lock
        self.sm = StateManager(node, arenas, host_memory_bytes, Path(workdir) / f"node{node}" / "spill",
                               self.telemetry, self.buffers, self.changed, self._drop_copies)
        self.group = GroupScheduler(node, devices, self.sm, Policy.parse(policy), self.telemetry, self.changed,
                                    self._step_on_node, prefetch=prefetch, read_replicas=read_replicas)
        self.recovery = {"worker_restarts": 0, "restored_states": 0, "lost_work_s": 0.0}
        self._incarnations: dict[int, str] = {}  # device -> the worker process last heard from
        self._restarting: set[int] = set()  # devices whose dispatcher must wait for their new worker
        self._samplers: dict[tuple[str, str], str] = {}
        # retired snapshot -> its (trainer, name): a call racing the sync that retired it follows it
        self._superseded: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._bases: dict[str, object] = {}  # source -> the frozen base module its LoRA states share
        self._bases_lock = threading.Lock()
        self._versions: dict[tuple[str, str], int] = {}
        self._order = threading.Lock()
        self._next_seq: dict[tuple[int, str], int] = {}
        self._early: dict[tuple[int, str], dict[int, Request]] = {}  # calls that overtook earlier ones
        self._dispatchers = [threading.Thread(target=self._dispatch_loop, args=(d,), daemon=True,
                                              name=f"plexrl-dispatch-{d}") for d in devices]
        for thread in self._dispatchers:
            thread.start()

    # -- states ---------------------------------------------------------------------------------
    def add_model(self, job: str, name: str, source: str, trainable: bool,
                  lora_config: LoraConfig | None = None, sampler: str = "hf") -> StateHandle:
        check_vllm_state(sampler, lora_config)
        measure = self._reserve_by_hand is None
        autocast = activation.trainer_autocast(self._precision())  # the reserve is a trainer's
        prepared = [worker.prepare.remote(source, self._probe_tokens, measure, autocast)  # meanwhile, there
                    for worker in self.workers.values()]
        module = load_module(source) if lora_config is None else self._lora_module(source, lora_config)
        dtype, autocast = precision.state_dtypes(self._precision(), trainable, lora_config)
        state = ModelState(f"{job}/{name}", job, name, module, trainable, source, lora=lora_config, sampler=sampler,
                           dtype=dtype, autocast=autocast)
        self._book_needs(source, prepared)
        self.sm.add(state, self.group.pending)
        self._fit_arenas()
        return self._handle(state)

    def _book_needs(self, source: str, prepared: list) -> None:
        """What a model of `source` needs beside its state, from the workers' `prepare` replies
        (every worker of the node can run it from its first call on): the largest reserve any
        device measured, or the one set by hand, and its vLLM engine's share."""
        needs = []
        for ref in prepared:
            try:
                needs.append(remote.get(ref))
            except Exception as exc:  # a worker that died meanwhile loads the template on first use
                if not remote.is_gone(exc):
                    raise
        if not needs:
            raise errors.WorkerFailed(f"no worker of node {self.node} answered while model folder {source!r} was "
                                      "prepared; the model was not added and may be added again")
        reserve = self._reserve_by_hand if self._reserve_by_hand is not None else max(r for r, _ in needs)
        with self.changed:
            known = self.sm.reserves.get(source)
            self.sm.reserves[source] = reserve
            self.sm.engine_shares[source] = max(e for _, e in needs)
        if known is None:
            self.telemetry.events.emit(self.telemetry.now(), "activation_reserve", node=self.node, source=source,
                                       bytes=reserve, measured=self._reserve_by_hand is None,
                                       probe_tokens=self._probe_tokens)

    def _fit_arenas(self, holding: frozenset[str] = frozenset()) -> None:
        """Give the node's arenas the size its states leave them (StateManager.arena_bytes) where
        that is smaller, or larger: the devices concerned get no new call, and once each waits
        between calls with none of its resident states in use (but those the caller `holding`s,
        whose node function uses only the host copy), their device copies are forgotten and the
        workers let their arenas go. Returns at once when the cluster is closing."""
        with self.changed:
            stale = self._stale_arenas()
            if not stale:
                return
            self.group.hold(stale)
            try:
                while not self._quiet(stale, holding):
                    if not all(thread.is_alive() for thread in self._dispatchers):
                        return
                    self.changed.wait(RESTART_POLL_S)
                size = self.sm.arena_bytes()
                for state in list(self.sm.states.values()):
                    if state.tier is Tier.DEVICE and state.device in stale:
                        self.sm.forget_device_copy(state)
                for device in stale:
                    self._resize(device, size)
            finally:
                self.group.hold(stale, held=False)

    def _stale_arenas(self) -> list[int]:
        size = self.sm.arena_bytes()
        return [d for d, arena in self.sm.arenas.items() if arena.capacity_bytes != size - size % FLOAT_BYTES]

    def _quiet(self, devices: list[int], holding: frozenset[str]) -> bool:
        return all(self.group.between_calls(d) for d in devices) and not any(
            s.busy and s.tier is Tier.DEVICE and s.device in devices and s.state_id not in holding
            for s in self.sm.states.values())

    def _resize(self, device: int, size: int) -> None:
        """Waited for, under the node's lock: no later call can reach the worker before it."""
        try:
            remote.get(self.workers[device].resize.remote(size))
        except Exception as exc:  # a worker restarting: its new arena is sized when it is back
            if not remote.is_gone(exc):
                raise
        self.sm.arenas[device].resize(size)

    def _handle(self, state: ModelState) -> StateHandle:
        return StateHandle(state.state_id, state.job, state.name, state.source, state.trainable, state.device_bytes,
                           state.host_bytes, state.lora, state.sampler, self.sm.reserves.get(state.source, 0),
                           self.sm.engine_shares.get(state.source, 0) if state.sampler == "vllm" else 0)

    def _lora_module(self, source: str, lora_config: LoraConfig):
        """A LoRA module over this node's one frozen base of `source` (loaded on first use)."""
        with self._bases_lock:
            if source not in self._bases:
                self._bases[source] = lora.frozen(load_module(source))
        return lora.lora_module(self._bases[source], lora_config)

    def _precision(self) -> str:
        """The node's resolved precision; "auto" (Ray) is resolved from what its first worker
        that answers runs on (every worker of a node is on its machine)."""
        if self.precision == "auto":
            for worker in self.workers.values():
                try:
                    self.precision = precision.resolve("auto", remote.get(worker.runs_on.remote()))
                    break
                except Exception as exc:  # a worker restarting: ask the next one
                    if not remote.is_gone(exc):
                        raise
            else:
                raise errors.WorkerFailed(f"no worker of node {self.node} answered what device it runs on; "
                                          "the model was not added and may be added again")
        return self.precision

    def remove_job(self, job: str, states: list[str] | None = None) -> None:
        """Free every state of `job` (only `states`, when given) once its queued calls are done."""
        for sid in [sid for sid, s in list(self.sm.states.items())
                    if s.job == job and not s.replica_of and (states is None or sid in states)]:
            with self.changed:
                while self.sm.in_use(sid, self.group.pending):
                    self.changed.wait(0.01)
                self._remove(sid)
        if not any(s.job == job for s in list(self.sm.states.values())):
            self.group.forget_job(job)  # its last state here is gone

    def step_mark(self, job: str, slack: float) -> None:
        """A step of `job` starts (it ended one, or was admitted or moved here): the scheduler's slack
        term counts the step's waits afresh."""
        self.group.step_mark(job, slack, self.telemetry.now())

    def _drop_copies(self, state_id: str) -> None:
        for worker in self.workers.values():
            worker.drop.remote(state_id)  # not waited for: a worker runs its calls in order

    def _remove(self, state_id: str) -> None:
        source = self.sm.states[state_id].source
        gone = self.sm.remove(state_id)
        with self._bases_lock:  # the last LoRA state of a base lets the node's copy go
            if not any(s.lora is not None and s.source == source for s in list(self.sm.states.values())):
                self._bases.pop(source, None)
        for worker in self.workers.values():
            for sid in gone:
                worker.forget.remote(sid)

    # -- calls ------------------------------------------------------------------------------------
    def call(self, call: Call) -> Any:
        """`enqueue` and block until the call is done (what a front calls through Ray)."""
        return self.enqueue(call).result()

    def enqueue(self, call: Call, future: APIFuture | None = None) -> APIFuture:
        """Queue one call behind the earlier calls of its model from the same front; its future
        (`future` when the caller, in this process, gives its own)."""
        request = Request(call.request_id, call.job, call.state_id, call.fn, call.payload,
                          future or APIFuture(call.request_id), self.telemetry.now(), seq=call.request_id)
        key = (call.caller, call.state_id)
        with self._order:  # queue every call that is next in its sequence (this one may unblock later ones)
            early = self._early.setdefault(key, {})
            early[call.seq] = request
            expected = self._next_seq.get(key, 0)
            while expected in early:
                self._submit(early.pop(expected))
                expected += 1
            self._next_seq[key] = expected
        return request.future

    def _submit(self, request: Request) -> None:
        try:
            self._follow_superseded(request)
            self._check_not_torn(request)
            self.group.submit(request)
        except errors.StateLost as lost:
            request.future.set_exception(lost)

    def _follow_superseded(self, request: Request) -> None:
        """A call that reaches the node after a sync retired and dropped its sampler snapshot
        (its client named the snapshot that was latest when the call was made, and the sync ran
        before the call arrived) runs on the snapshot that replaced it: a sampling client follows
        the latest sync (`api.client.SamplingClient`). A snapshot still here keeps its calls."""
        key = self._superseded.get(request.state_id)
        if key is not None and request.state_id not in self.sm.states and key in self._samplers:
            request.state_id = self._samplers[key]

    def _check_not_torn(self, request: Request) -> None:
        """A torn (or unreadable) state takes nothing but a restore (load_state)."""
        if request.fn == "load_state":
            return
        if request.state_id in self._torn:
            raise errors.StateLost(self._torn_message(request.state_id, "died earlier"))
        state = self.sm.states.get(request.state_id)
        if state is not None and state.unreadable:
            raise errors.StateLost(f"model {request.state_id!r} could not be read back from its spill file; restore "
                                   "it from a checkpoint with load_state_with_optimizer(path) before using it")

    # -- the step: one request, on a device or on the node ----------------------------------------
    def _dispatch_loop(self, device: int) -> None:
        while (item := self.group.next_for(device)) is not None:
            self._step(device, *item)

    def _step(self, device: int, request: Request, plan: LoadPlan, prefetch: LoadPlan | None = None) -> None:
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
            self._check_not_torn(request)  # it may have been torn while this call waited
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
            error = self._worker_died(device, request, dispatched, exc) if died else exc
        if prefetch is not None:  # before the call resolves: its caller's next call may want that state
            self._release(prefetch)
            if self.sm.states[prefetch.state_id].tier is Tier.DEVICE:
                self.group.prefetched(prefetch.state_id, device)
        self._finish(request, plan, device, result, error, timing)
        if device in self._restarting:
            self._await_restart(device)  # the caller knows already: it may retry on another device

    def _step_on_node(self, request: Request, plan: LoadPlan) -> None:
        """A node function, on the host copy (the group scheduler claimed the state)."""
        started = self.telemetry.now()
        self.telemetry.waited(request.job, started - request.arrival_s)
        self._emit(started, "start", request, None)
        result, error = None, None
        try:
            self._check_not_torn(request)
            result = self._run_on_node(request, self.sm.states[request.state_id])
        except Exception as exc:
            error = exc
        self._finish(request, plan, None, result, error, {})

    def _release(self, plan: LoadPlan) -> None:
        """Free what `plan` claimed; a state retired meanwhile goes if nothing is queued for it."""
        self.sm.release(plan, self.telemetry.now())
        self.group.released({plan.state_id, *(t.state_id for t in plan.transitions)})

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
        self.group.complete(request, resolved[0][2])
        for call, value, failure in resolved:
            if failure is not None:
                call.future.set_exception(failure)
            else:
                call.future.set_result(value)

    def _run_on_node(self, request: Request, state: ModelState) -> Any:
        if request.fn == "sync_weights":
            return self._sync(state, request.payload.name, request.payload.sampler)
        start, t0 = self.telemetry.now(), time.perf_counter()
        result = functions.execute(request.fn, state, request.payload)
        if request.fn == "save_state":
            result, written = result
            self.telemetry.transition(Transition(TransitionKind.MATERIALIZE, state.state_id, written), request.job,
                                      written, time.perf_counter() - t0, self.node, start)
        if request.function.mutates:
            self.sm.host_copy_changed(state)
            self._torn.discard(state.state_id)  # restored: its host copy is whole again
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
            start, dirty = self.telemetry.now(), self.sm.states[t.state_id].dirty
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
                          and not self.sm.states[t.state_id].dirty)
        if not early:
            return plan, early
        with self.changed:
            self.sm.let_go(early)
            self.group.released({t.state_id for t in early})
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
        state = self.sm.states[t.state_id]
        if t.kind is TransitionKind.LOAD:
            spec = StateSpec(state.state_id, state.job, state.name, state.source, state.trainable, state.lora,
                             state.sampler, state.dtype, state.autocast)
            return WorkerStep(t.kind, t.state_id, spec, str(self.buffers.path_of(self.sm.host_of(state))), t.offset,
                              state.adam_step, weights_version=state.weights_version)
        return WorkerStep(t.kind, t.state_id, dirty=state.dirty)

    def _book(self, steps: list[Transition], reply: WorkerReply, request: Request, device: int, start: float,
              ahead: list[Transition] = (), let_go: frozenset[Transition] = frozenset()) -> None:
        """Book what the worker ran: `steps`, the call, the prefetch `ahead`. The offloads in
        `let_go` moved the node's view at dispatch (`_let_go_here`): only booked here."""
        loaded = {t.state_id for t in steps} | {request.state_id} | ({ahead[-1].state_id} if reply.prefetch_s else set())
        self._check_incarnation(device, reply.incarnation, loaded)
        for t, seconds in zip(steps, reply.steps_s):
            if t in let_go:
                self.sm.book(t, request.job, seconds, start, 0)
            else:
                self._record(t, request.job, seconds, start)
            start += seconds
        for call in request.calls:
            self._emit(start, "start", call, device)
        if reply.prefetch_s:  # charged to the job it was for; its load only for the part the function did not hide
            job = self.sm.states[ahead[-1].state_id].job
            at = start
            for t, seconds in zip(ahead, reply.prefetch_s):
                charged = reply.prefetch_exposed_s if t.kind is TransitionKind.LOAD else None
                self._record(t, job, seconds, at, charged)
                at += seconds if charged is None else charged
            self.telemetry.prefetched(ahead[-1].bytes, reply.prefetch_s[-1], reply.prefetch_exposed_s)
        state = self.sm.states[request.state_id]
        state.adam_step = reply.adam_step
        for call, share in zip(request.calls, shares(reply.result, len(request.calls))):
            self.telemetry.executed(call.job, self.sm.primary_of(request.state_id), call.fn, device,
                                    reply.device_s * share, reply.wall_s * share)
        if isinstance(reply.result, functions.BatchReply) and reply.result.stats is not None:  # fits the decode model
            stats = reply.result.stats
            self.telemetry.decoded(self.sm.primary_of(request.state_id), stats.steps, stats.row_steps,
                                   stats.prefill_tokens, reply.device_s)
            self._emit(start, "batch", request, device, calls=len(request.calls), steps=stats.steps,
                       row_steps=stats.row_steps, prefill_tokens=stats.prefill_tokens, slots=list(stats.slots),
                       device_s=reply.device_s, wall_s=reply.wall_s)
        if request.function.mutates:  # the write-through is a host snapshot: charged like a materialization
            write = Transition(TransitionKind.MATERIALIZE, request.state_id, reply.writeback_bytes)
            self.telemetry.transition(write, request.job, reply.writeback_bytes, reply.writeback_s, self.node,
                                      self.telemetry.now(), state.device_bytes)
            self.telemetry.wrote_back(reply.writeback_bytes, reply.writeback_zeroed_bytes, reply.writeback_s)

    def _record(self, t: Transition, job: str, seconds: float, start: float, charged_s: float | None = None) -> None:
        moved = t.bytes if t.kind is TransitionKind.LOAD or self.sm.states[t.state_id].dirty else 0
        self.sm.record(t, job, seconds, start, moved, charged_s)

    def _check_incarnation(self, device: int, incarnation: str, loaded_now: set[str]) -> None:
        """A reply from a new worker process (the old one died between calls): whatever the node
        thought resident there, apart from what this call loaded, is gone: back to host copies."""
        known = self._incarnations.setdefault(device, incarnation)
        if known == incarnation:
            return
        self._incarnations[device] = incarnation
        with self.changed:
            gone = [s for s in self.sm.states.values()
                    if s.tier is Tier.DEVICE and s.device == device and s.state_id not in loaded_now]
            for state in gone:
                self.sm.forget_device_copy(state)
        self.recovery["worker_restarts"] += 1
        self.recovery["restored_states"] += len(gone)
        self.telemetry.events.emit(self.telemetry.now(), "worker_restarted", node=self.node, device=device,
                                   restored=[s.state_id for s in gone], found="idle")

    # -- a worker that died ------------------------------------------------------------------------
    def _worker_died(self, device: int, request: Request, dispatched: float, exc: BaseException) -> errors.PlexRLError:
        lost_s = self.telemetry.now() - dispatched
        torn = bool(self.writeback[device])
        if torn:
            self.writeback[device] = 0
            self._torn.add(request.state_id)
        restored = [sid for sid in self.sm.lose_device(device) if sid not in self._torn]
        self.recovery["worker_restarts"] += 1
        self.recovery["restored_states"] += len(restored)
        self.recovery["lost_work_s"] += lost_s
        self.telemetry.events.emit(self.telemetry.now(), "worker_failed", node=self.node, device=device,
                                   request_id=request.id, job=request.job, model=request.state_id,
                                   restored=restored, lost_work_s=lost_s, cause=type(exc).__name__,
                                   torn=[request.state_id] if torn else [])
        self._restarting.add(device)
        if torn:
            return errors.StateLost(self._torn_message(request.state_id, f"died while writing back {request.fn}'s result"))
        return errors.WorkerFailed(
            f"the worker of device {device} on node {self.node} died while running {request.fn} on "
            f"{request.state_id!r}; the call did not take effect (its state is back to its last completed call) "
            "and may be submitted again")

    def _torn_message(self, state_id: str, what: str) -> str:
        return (f"model {state_id!r} is lost: its worker {what}, leaving its host copy half written; restore it "
                "from a checkpoint with load_state_with_optimizer(path) (load_state for weights only) before using it")

    def _await_restart(self, device: int) -> None:
        """Hold this device's dispatcher until the host has restarted its worker, so that no
        further request is sent to (and failed by) a worker that is not back yet."""
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                remote.get(self.workers[device].ping.remote(), timeout=RESTART_TIMEOUT_S)
                remote.get(self.workers[device].resize.remote(self.sm.arenas[device].capacity_bytes))  # born at the budget
                self.telemetry.events.emit(self.telemetry.now(), "worker_restarted", node=self.node, device=device)
                self._incarnations.pop(device, None)  # counted at the death: the new process's first reply is not news
                self._restarting.discard(device)
                return
            except Exception as exc:
                if not remote.is_gone(exc):
                    raise
                time.sleep(RESTART_POLL_S)  # the new process is still starting
        raise RuntimeError(f"the worker of device {device} on node {self.node} did not restart "
                           f"within {RESTART_TIMEOUT_S} s")

    # -- weight sync (on the node: host copies are current by write-through) ----------------------
    def _sync(self, trainer: ModelState, name: str, sampler: str = "hf") -> Synced:
        """`trainer`'s weights become its sampler snapshot `name`'s: in place when nobody uses the
        snapshot (and it samples with `sampler`), else in a new version (the old one retires once
        its queued calls drain)."""
        check_vllm_state(sampler, trainer.lora)
        weights = trainer.segment(trainer.host, 0)
        key = (trainer.state_id, name)
        with self.changed:
            current = self._samplers.get(key)
            snapshot = self.sm.states.get(current) if current else None
            reusable = (snapshot is not None and not self.sm.in_use(current, self.group.pending)
                        and snapshot.tier is not Tier.DISK and snapshot.sampler == sampler)
            if reusable:
                snapshot.busy = True
                snapshot.weights_version += 1  # a vLLM engine holding the old ones pushes these
                self.sm.host_copy_changed(snapshot)  # rewritten below
        if reusable:
            self.sm.materialize(snapshot, trainer.job,  # rounded to nearest into a bfloat16 snapshot
                                lambda: snapshot.segment(snapshot.host, 0).copy_(weights).nbytes)
            with self.changed:
                snapshot.busy = False
                self.changed.notify_all()
            return Synced(self._handle(snapshot), name)
        version = self._versions[key] = self._versions.get(key, 0) + 1
        module = (skeleton_like(trainer.module) if trainer.lora is None
                  else self._lora_module(trainer.source, trainer.lora))  # a snapshot of an adapter is an adapter
        dtype, _ = precision.state_dtypes(self._precision(), False, trainer.lora)
        fresh = ModelState(f"{trainer.state_id}@{name}.v{version}", trainer.job, f"{trainer.name}@{name}",
                           module, False, trainer.source, lora=trainer.lora, sampler=sampler, dtype=dtype)
        self.sm.add(fresh, self.group.pending, initial=weights, holding=frozenset({trainer.state_id}))
        self._fit_arenas(holding=frozenset({trainer.state_id}))  # a first vLLM snapshot keeps its engine's share
        self._samplers[key] = fresh.state_id
        if snapshot is not None:
            self._superseded[snapshot.state_id] = key
            while len(self._superseded) > SUPERSEDED_KEPT:
                self._superseded.popitem(last=False)
            self.group.retire(snapshot.state_id, lambda sid=snapshot.state_id: self._remove(sid))
        return Synced(self._handle(fresh), name)

    # -- observability and lifecycle ---------------------------------------------------------------
    def _emit(self, t: float, event: str, request: Request, device: int | None, **extra) -> None:
        self.telemetry.events.emit(t, event, request_id=request.id, job=request.job, model=request.state_id,
                                   fn=request.fn, device=device, node=self.node, **extra)

    def summary(self) -> dict:
        out = self.telemetry.summary()
        out["recovery"] = dict(self.recovery)
        with self.changed:
            out["residency"] = {sid: f"device:{s.device}" if s.tier is Tier.DEVICE else s.tier.value
                                for sid, s in self.sm.states.items()}
            out["device_budget"] = {d: self._budget_of(d) for d in self.sm.arenas}
            out["activation_reserves"] = dict(self.sm.reserves)
        return out

    def _budget_of(self, device: int) -> dict:
        """How a device's budget is split: what is kept beside the states, and what states may use."""
        beside, arena = self.sm.beside(), self.sm.arenas[device]
        return {"device_memory_bytes": arena.budget_bytes, "activation_reserve_bytes": beside.reserve_bytes,
                "activation_reserve_of": beside.reserve_of, "engine_bytes": beside.engine_bytes,
                "shared_bytes": beside.shared_bytes, "state_bytes": min(arena.capacity_bytes, self.sm.arena_bytes())}

    def events(self, job: str | None = None, since: float | None = None) -> list[dict]:
        return self.telemetry.events.snapshot(job, since)

    def recent(self, since: float) -> dict:
        """Per device, its spans ending at `since` or later, per job its first arrival and latest end
        (runtime/activity.py)."""
        return self.telemetry.events.recent(since)

    def where(self) -> str:
        """The Ray node id this node runs on (affinity checks; Ray engine only)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def state_ids(self) -> list[str]:
        """The models on this node (read replicas are the node's own, not listed)."""
        with self.changed:
            return sorted(sid for sid, s in self.sm.states.items() if not s.replica_of)

    def close(self) -> None:
        self.group.close()
        for thread in self._dispatchers:
            thread.join(timeout=60)
        for worker in self.workers.values():  # their vLLM engine processes (a worker process's die with it)
            worker.close.remote()
        self.buffers.release_all()
