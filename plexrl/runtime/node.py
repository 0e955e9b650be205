"""One node: its StateManager, its group scheduler, and a dispatcher per device (docs/design.md §2, §8).

    Node (one per node group; hosted in the driver, in a thread pool, or as a Ray actor)
      ├ StateManager   residency, budgets, host buffers in shared memory, spill files (state_manager.py)
      ├ GroupScheduler the policy picks, plans and claims (scheduler.py)
      ├ NodeModels     making and removing model states, arena sizes (node_models.py)
      ├ StepRunner     one request on a device or on the node, booked and resolved (step_runner.py)
      ├ WorkerHealth   dead and restarted workers, torn host copies (worker_health.py)
      ├ WeightSync     sampler snapshots of trainers (weight_sync.py)
      └ a dispatcher thread per device: next request -> StepRunner.step -> DeviceWorker.run

The node owns residency and every host copy; a DeviceWorker owns only its arena. Node functions
(functions.Where.NODE: checkpoints, weight sync, reading weights) run here on the host copy,
which write-through keeps current.

The node's one lock is `Node.lock`, a condition over a reentrant lock that the node makes and
hands to its StateManager, its group scheduler and its parts, which all keep it as `lock`:
every change to residency, claims and the queue happens under it, and waiters on it are woken
when states are released or requests complete.

Calls arrive as `Call`s numbered per (front, model); they enter the group's queue in that order
whatever order the transport delivers them in (call_order.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plexrl.api import errors
from plexrl.api.cluster import StateHandle
from plexrl.api.futures import APIFuture
from plexrl.api.types import LoraConfig
from plexrl.policy import LoadPlan, Policy
from plexrl.runtime.arena import DeviceArena
from plexrl.runtime.call_order import CallOrder
from plexrl.runtime.events import EventLog
from plexrl.runtime.host_buffers import SharedHostBuffers, sweep_stale
from plexrl.runtime.node_models import NodeModels
from plexrl.runtime.scheduler import GroupScheduler, Request
from plexrl.runtime.state_manager import StateManager
from plexrl.runtime.step_runner import StepRunner
from plexrl.runtime.telemetry import Telemetry
from plexrl.runtime.weight_sync import WeightSync
from plexrl.runtime.worker_health import WorkerHealth


@dataclass(frozen=True)
class NodeConfig:
    """What a node is made from (the front builds one per node group, runtime/front.py)."""

    node: int  # the node group's number
    devices: list[int]  # its devices' indices
    workers: dict  # device index -> DeviceWorker handle
    device_memory_bytes: int  # each device's budget
    host_memory_bytes: int  # the node's host budget
    policy: str  # the group scheduler's policy (policy.Policy.parse)
    workdir: str  # the cluster's folder: spill files go under node<N>/spill
    shm_folder: str  # the node's shared-memory folder for host buffers
    epoch: float  # the front's time axis (time.time() at the cluster's start)
    event_log: str | None = None  # a file the events are written to as well
    prefetch: bool = True  # plan loading the state a device likely runs next beside each call
    precision: str = "fp32"  # "fp32", "bf16", or "auto": asked of the workers (Ray)
    activation_reserve_bytes: int | None = None  # every model's reserve by hand (None: measured)
    activation_probe_tokens: int | None = None  # the batch the workers measure a reserve on
    events_kept: int | None = None  # the events kept in memory
    read_replicas: bool = True  # run a weights-only state's calls on several devices at once


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


class Node:
    def __init__(self, config: NodeConfig):
        self.node = config.node
        self.workers = config.workers  # device index -> DeviceWorker handle
        import transformers.models.auto.modeling_auto  # noqa: F401  (see DeviceWorker.__init__)
        self.telemetry = Telemetry(EventLog(config.event_log, config.events_kept), epoch=config.epoch)
        arenas = {d: DeviceArena(d, config.device_memory_bytes) for d in config.devices}  # budgets only, never allocated
        sweep_stale()  # what dead drivers left on this machine
        self.buffers = SharedHostBuffers(config.shm_folder)
        writeback = self.buffers.flags(max(config.devices) + 1)  # set while a worker writes a host copy back
        self.lock = threading.Condition(threading.RLock())  # the node's one lock (module docstring)
        self.sm = StateManager(config.node, arenas, config.host_memory_bytes,
                               Path(config.workdir) / f"node{config.node}" / "spill", self.telemetry, self.buffers,
                               self.lock, self._drop_copies)
        self.scheduler = GroupScheduler(config.node, config.devices, self.sm, Policy.parse(config.policy),
                                        self.telemetry, self.lock, self._step_on_node, prefetch=config.prefetch,
                                        read_replicas=config.read_replicas)
        self.models = NodeModels(config, self.sm, self.scheduler, self.lock, self.telemetry, self._dispatching)
        self.health = WorkerHealth(config.node, self.workers, self.sm, self.telemetry, writeback, self.lock)
        self.weight_sync = WeightSync(self.models, self.sm, self.scheduler, self.lock)
        self.runner = StepRunner(config.node, self.workers, self.sm, self.scheduler, self.telemetry, self.buffers,
                                 self.health, self.weight_sync, self.lock)
        self._order = CallOrder(self._submit)
        self._dispatchers = [threading.Thread(target=self._dispatch_loop, args=(d,), daemon=True,
                                              name=f"plexrl-dispatch-{d}") for d in config.devices]
        for thread in self._dispatchers:
            thread.start()

    # -- models ------------------------------------------------------------------------------------
    def add_model(self, job: str, name: str, source: str, trainable: bool,
                  lora_config: LoraConfig | None = None, sampler: str = "hf") -> StateHandle:
        return self.models.add(job, name, source, trainable, lora_config, sampler)

    def remove_job(self, job: str, states: list[str] | None = None) -> None:
        """Free every state of `job` (only `states`, when given) once its queued calls are done."""
        self.models.remove_job(job, states)

    def step_mark(self, job: str, slack: float) -> None:
        """A step of `job` starts (it ended one, or was admitted or moved here): the scheduler's slack
        term counts the step's waits afresh."""
        self.scheduler.step_mark(job, slack, self.telemetry.now())

    def _drop_copies(self, state_id: str) -> None:
        for worker in self.workers.values():
            worker.drop.remote(state_id)  # not waited for: a worker runs its calls in order

    # -- calls ------------------------------------------------------------------------------------
    def call(self, call: Call) -> Any:
        """`enqueue` and block until the call is done (what a front calls through Ray)."""
        return self.enqueue(call).result()

    def enqueue(self, call: Call, future: APIFuture | None = None) -> APIFuture:
        """Queue one call behind the earlier calls of its model from the same front; its future
        (`future` when the caller, in this process, gives its own)."""
        request = Request(call.request_id, call.job, call.state_id, call.fn, call.payload,
                          future or APIFuture(call.request_id), self.telemetry.now(), seq=call.request_id)
        self._order.arrive(call.caller, call.state_id, call.seq, request)
        return request.future

    def _submit(self, request: Request) -> None:
        try:
            self.weight_sync.follow_superseded(request)
            self.health.check_not_torn(request)
            self.scheduler.submit(request)
        except errors.StateLost as lost:
            request.future.set_exception(lost)

    # -- the dispatchers ---------------------------------------------------------------------------
    def _dispatch_loop(self, device: int) -> None:
        while (item := self.scheduler.next_for(device)) is not None:
            self.runner.step(device, *item)

    def _step_on_node(self, request: Request, plan: LoadPlan) -> None:
        self.runner.on_node(request, plan)

    def _dispatching(self) -> bool:
        return all(thread.is_alive() for thread in self._dispatchers)

    # -- observability and lifecycle ---------------------------------------------------------------
    def summary(self) -> dict:
        out = self.telemetry.summary()
        out["recovery"] = dict(self.health.recovery)
        with self.lock:
            out["residency"] = self.sm.states.residency()
            out["device_budget"] = {d: self.sm.budgets.split(d) for d in self.sm.arenas}
            out["activation_reserves"] = self.sm.budgets.reserves()
        return out

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
        with self.lock:
            return self.sm.states.model_ids()

    def close(self) -> None:
        self.scheduler.close()
        for thread in self._dispatchers:
            thread.join(timeout=60)
        for worker in self.workers.values():  # their vLLM engine processes (a worker process's die with it)
            worker.close.remote()
        self.buffers.release_all()
