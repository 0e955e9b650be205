"""One node of the Ray engine: its StateManager and group scheduler, hosted as a Ray actor.

    RayNode (pinned to its node by node affinity)
      ├ SharedStateManager  runtime.state_manager.StateManager with host buffers in shared memory;
      │                     device-side transitions run by the workers, recorded here
      ├ GroupScheduler      runtime.scheduler, unchanged: the policy picks, plans and claims
      └ one dispatcher thread per device: next request -> DeviceWorker actor.run(steps, fn, payload)

The node owns residency and every host copy; a DeviceWorker owns only its arena. When a worker
dies, its in-flight request fails with errors.WorkerFailed (retriable: nothing is retried behind
the caller's back, because only the caller knows whether repeating it is right), every state that
was resident on the device falls back to its host copy (current by write-through), Ray restarts
the worker, and the next request for those states loads them again.

Calls arrive as (function name, payload) with a sequence number per (front, model); they enter
the group's queue in that order whatever order Ray delivers them in (calls of one model from one
front run in submission order).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import ray
import torch

from plexrl import errors
from plexrl.engines import hosting
from plexrl.engines.ray_shm import SharedHostBuffers
from plexrl.policy import LoadPlan, Policy, Tier, Transition, TransitionKind
from plexrl.runtime.arena import DeviceArena
from plexrl.runtime.events import EventLog, job_events
from plexrl.api.futures import APIFuture
from plexrl.runtime.scheduler import GroupScheduler, Request, as_user_error
from plexrl.runtime.state import ModelState, load_module, skeleton_like
from plexrl.runtime.state_manager import StateManager, host_side_end
from plexrl.runtime.telemetry import Telemetry

WORKER_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, hosting.WorkerGone)
RESTART_TIMEOUT_S = 300.0
RESTART_POLL_S = 0.05


class SharedStateManager(StateManager):
    """The local StateManager with host buffers other processes can map, and device-side
    transitions recorded from what a worker reports instead of run in this process."""

    def __init__(self, node: int, arenas: dict[int, DeviceArena], host_capacity: int, spill_dir: Path,
                 telemetry: Telemetry, buffers: SharedHostBuffers):
        super().__init__(node, arenas, host_capacity, spill_dir, telemetry)
        self.buffers = buffers

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        return self.buffers.allocate(nbytes)

    def _spill(self, state: ModelState, t: Transition) -> int:
        host = state.host
        moved = super()._spill(state, t)
        self.buffers.release(host)
        return moved

    def remove(self, state_id: str) -> None:
        with self.lock:
            host = self.states[state_id].host
            super().remove(state_id)
            self.buffers.release(host)

    def device_steps(self, plan: LoadPlan) -> tuple[Transition, ...]:
        return plan.transitions[host_side_end(plan):]

    def record(self, t: Transition, job: str, seconds: float, start: float, moved: int) -> None:
        """Book a device-side transition a worker ran (the state is claimed busy by the plan)."""
        state = self.states[t.state_id]
        with self.lock:
            if t.kind is TransitionKind.LOAD:
                state._resident, state.tier, state.device, state.offset = None, Tier.DEVICE, t.device, t.offset
            else:
                state.detach_to_host()
            state.dirty = False
        self.telemetry.transition(t, job, moved, seconds, self.node, start, t.bytes)

    def lose_device(self, device: int) -> list[str]:
        """The device's worker died: every state resident there is back to its host copy."""
        with self.lock:
            lost = [s for s in self.states.values() if s.tier is Tier.DEVICE and s.device == device]
            for state in lost:
                state.detach_to_host()
                state.dirty = False
            self.changed.notify_all()
        return [s.state_id for s in lost]


def spec_of(state: ModelState) -> dict:
    """What a worker needs to build its own copy of a state's module."""
    return {"state_id": state.state_id, "job": state.job, "name": state.name, "source": state.source,
            "trainable": state.trainable}


class RayNode:
    def __init__(self, node: int, devices: list[int], workers: dict, device_memory_bytes: int,
                 host_memory_bytes: int, policy: str, workdir: str, shm_folder: str, epoch: float):
        self.node = node
        self.workers = workers  # device index -> DeviceWorker actor handle
        import transformers.models.auto.modeling_auto  # noqa: F401  (see DeviceWorker.__init__)
        self.telemetry = Telemetry(EventLog(), epoch=epoch)  # the driver's time axis
        arenas = {d: DeviceArena(d, device_memory_bytes) for d in devices}  # budgets only: never allocated here
        self.buffers = SharedHostBuffers(shm_folder)
        self.writeback = self.buffers.flags(max(devices) + 1)  # set while a worker writes a host copy back
        self._torn: set[str] = set()  # states whose host copy a dying worker left half written
        self.sm = SharedStateManager(node, arenas, host_memory_bytes, Path(workdir) / f"node{node}" / "spill",
                                     self.telemetry, self.buffers)
        self.group = GroupScheduler(node, devices, self.sm, Policy.parse(policy), self.telemetry)
        self.sm.pending = self.group.pending
        self.recovery = {"worker_restarts": 0, "restored_states": 0, "lost_work_s": 0.0}
        self._samplers: dict[tuple[str, str], str] = {}
        self._versions: dict[tuple[str, str], int] = {}
        self._order = threading.Lock()
        self._next_seq: dict[tuple[int, str], int] = {}
        self._early: dict[tuple[int, str], dict[int, Request]] = {}  # calls that overtook earlier ones
        self._dispatchers = [threading.Thread(target=self._dispatch_loop, args=(d,), daemon=True,
                                              name=f"plexrl-dispatch-{d}") for d in devices]
        for thread in self._dispatchers:
            thread.start()

    # -- states ---------------------------------------------------------------------------------
    def add_model(self, job: str, name: str, source: str, trainable: bool) -> dict:
        prepared = [worker.prepare.remote(source) for worker in self.workers.values()]  # meanwhile, there
        module = load_module(source)
        state = ModelState(f"{job}/{name}", job, name, module, trainable, source)
        self.sm.add(state)
        hosting.get(prepared)  # every worker of the node can run the model from its first call on
        return {"state_id": state.state_id, "device_bytes": state.device_bytes, "host_bytes": state.host_bytes}

    def remove_job(self, job: str) -> None:
        for sid in [sid for sid, s in list(self.sm.states.items()) if s.job == job]:
            with self.sm.changed:
                while self.sm.states[sid].busy or self.sm.pending(sid):
                    self.sm.changed.wait(0.01)
                self._remove(sid)

    def _remove(self, state_id: str) -> None:
        self.sm.remove(state_id)
        for worker in self.workers.values():
            worker.forget.remote(state_id)

    # -- calls ------------------------------------------------------------------------------------
    def call(self, request_id: int, job: str, state_id: str, fn: str, payload: dict, mutates: bool, caller: int,
             seq: int) -> Any:
        """`enqueue` and block until the call is done (what a front calls through Ray)."""
        return self.enqueue(request_id, job, state_id, fn, payload, mutates, caller, seq).result()

    def enqueue(self, request_id: int, job: str, state_id: str, fn: str, payload: dict, mutates: bool, caller: int,
                seq: int) -> APIFuture:
        """Queue one call behind the earlier calls of its model from the same front (`caller`
        numbers its calls per model: `seq`); its future."""
        future = APIFuture(request_id)
        node_side = fn == "sync_weights"
        run = (lambda s: self._sync(s, payload["name"])) if node_side else payload
        request = Request(request_id, job, state_id, fn, run, future, self.telemetry.now(),
                          needs_device=not node_side, mutates=mutates, seq=request_id)
        key = (caller, state_id)
        with self._order:  # queue every call that is next in its sequence (this one may unblock later ones)
            early = self._early.setdefault(key, {})
            early[seq] = request
            expected = self._next_seq.get(key, 0)
            while expected in early:
                self._enqueue(early.pop(expected))
                expected += 1
            self._next_seq[key] = expected
        return future

    def _enqueue(self, request: Request) -> None:
        try:
            self._check_not_torn(request)
            self.group.submit(request)
        except errors.StateLost as lost:
            request.future.set_exception(lost)

    def _check_not_torn(self, request: Request) -> None:
        """A torn state takes nothing but a restore (load_state)."""
        if request.state_id in self._torn and request.fn != "load_state":
            raise errors.StateLost(self._torn_message(request.state_id, "died earlier"))

    def _dispatch_loop(self, device: int) -> None:
        while (item := self.group.next_for(device)) is not None:
            self._step(device, *item)

    def _step(self, device: int, request: Request, plan: LoadPlan) -> None:
        """What runtime.worker.Worker.step does, with the device in another process."""
        dispatched = self.telemetry.now()
        self.telemetry.waited(request.job, dispatched - request.arrival_s)
        self._emit(dispatched, "dispatch", request, device, switch=plan.is_switch)
        result, error, timing = None, None, {}
        try:
            self._check_not_torn(request)  # it may have been torn while this call waited
            steps = self._offload_elsewhere(plan, request.job, device)
            reply = hosting.get(self.workers[device].run.remote(
                [self._step_spec(t) for t in steps], request.fn, request.run, request.state_id, request.mutates))
            self._book(steps, reply, request, device, dispatched)
            timing = {"wall_s": reply["wall_s"], "device_s": reply["device_s"]}
            result, error = reply["result"], reply["error"]
            if request.fn == "load_state" and error is None:
                self._torn.discard(request.state_id)  # restored: its host copy is whole again
            if error is not None:
                error = as_user_error(error, request)
                self.telemetry.failed(request.job)
        except WORKER_GONE as exc:
            error = self._worker_died(device, request, dispatched, exc)
        except Exception as exc:
            error = as_user_error(getattr(exc, "cause", None) or exc, request)
            self.telemetry.failed(request.job)
        finally:
            self._emit(self.telemetry.now(), "end", request, device, ok=error is None, **timing)
            self.sm.release(plan, self.telemetry.now())
            self.group.complete(request)
        if error is not None:
            request.future.set_exception(error)
        else:
            request.future.set_result(result)

    def _offload_elsewhere(self, plan: LoadPlan, job: str, device: int) -> list[Transition]:
        """Run the plan's steps for other devices (the state itself resident elsewhere) there;
        return the steps for `device`."""
        mine = []
        for t in self.sm.device_steps(plan):
            if t.device == device:
                mine.append(t)
                continue
            start = self.telemetry.now()
            try:
                seconds = hosting.get(self.workers[t.device].offload.remote(t.state_id, self.sm.states[t.state_id].dirty))
            except WORKER_GONE:
                self.sm.lose_device(t.device)  # its copy is gone; the host copy is current
                continue
            self.sm.record(t, job, seconds, start, t.bytes if self.sm.states[t.state_id].dirty else 0)
        return mine

    def _step_spec(self, t: Transition) -> dict:
        state = self.sm.states[t.state_id]
        if t.kind is TransitionKind.LOAD:
            return {"kind": "load", "spec": spec_of(state), "host_path": str(self.buffers.path_of(state.host)),
                    "offset": t.offset, "adam_step": state.adam_step}
        return {"kind": "offload", "state_id": t.state_id, "dirty": state.dirty}

    def _book(self, steps: list[Transition], reply: dict, request: Request, device: int, start: float) -> None:
        for t, seconds in zip(steps, reply["steps_s"]):
            moved = t.bytes if t.kind is TransitionKind.LOAD or self.sm.states[t.state_id].dirty else 0
            self.sm.record(t, request.job, seconds, start, moved)
            start += seconds
        self._emit(start, "start", request, device)
        state = self.sm.states[request.state_id]
        state.adam_step = reply["adam_step"]
        self.telemetry.executed(request.job, request.state_id, request.fn, device, reply["device_s"], reply["wall_s"])
        if request.mutates:  # the write-through is a host snapshot: charged like a materialization
            write = Transition(TransitionKind.MATERIALIZE, request.state_id, state.device_bytes)
            self.telemetry.transition(write, request.job, state.device_bytes, reply["writeback_s"], self.node,
                                      self.telemetry.now())
        if request.fn == "save_state" and reply["error"] is None:
            reply["result"], written = reply["result"]
            self.telemetry.transition(Transition(TransitionKind.MATERIALIZE, request.state_id, written), request.job,
                                      written, reply["wall_s"], self.node, start)

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
        self.telemetry.failed(request.job)
        self.telemetry.events.emit(self.telemetry.now(), "worker_failed", node=self.node, device=device,
                                   request_id=request.id, job=request.job, model=request.state_id,
                                   restored=restored, lost_work_s=lost_s, cause=type(exc).__name__,
                                   torn=[request.state_id] if torn else [])
        self._await_restart(device)
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
        """Hold this device's dispatcher until Ray has restarted its worker, so that no further
        request is sent to (and failed by) a worker that is not back yet."""
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                hosting.get(self.workers[device].ping.remote(), timeout=RESTART_TIMEOUT_S)
                self.telemetry.events.emit(self.telemetry.now(), "worker_restarted", node=self.node, device=device)
                return
            except WORKER_GONE:
                time.sleep(RESTART_POLL_S)  # Ray is still starting the new process
        raise RuntimeError(f"the worker of device {device} on node {self.node} did not restart "
                           f"within {RESTART_TIMEOUT_S} s")

    # -- weight sync (runs on the node: host copies are current by write-through) -----------------
    def _sync(self, trainer: ModelState, name: str) -> dict:
        weights = trainer.segment(trainer.host, 0)
        key = (trainer.state_id, name)
        with self.sm.lock:
            current = self._samplers.get(key)
            snapshot = self.sm.states.get(current) if current else None
            reusable = (snapshot is not None and not snapshot.busy and self.group.pending(current) == 0
                        and snapshot.tier is not Tier.DISK)
            if reusable:
                snapshot.busy = True
                if snapshot.tier is Tier.DEVICE:
                    snapshot.detach_to_host()  # its device copy is stale now; the next use loads it again
        if reusable:
            self.sm.materialize(snapshot, trainer.job, lambda: snapshot.host.copy_(weights).numel() * 4)
            with self.sm.lock:
                snapshot.busy = False
                self.sm.changed.notify_all()
            return {"state_id": snapshot.state_id, "name": snapshot.name, "sync": name}
        version = self._versions[key] = self._versions.get(key, 0) + 1
        fresh = ModelState(f"{trainer.state_id}@{name}.v{version}", trainer.job, f"{trainer.name}@{name}",
                           skeleton_like(trainer.module), False, trainer.source)
        self.sm.add(fresh, initial=weights, holding=frozenset({trainer.state_id}))
        self._samplers[key] = fresh.state_id
        if snapshot is not None:
            self.group.retire(snapshot.state_id, lambda sid=snapshot.state_id: self._remove(sid))
        return {"state_id": fresh.state_id, "name": fresh.name, "sync": name}

    # -- observability and lifecycle ---------------------------------------------------------------
    def _emit(self, t: float, event: str, request: Request, device: int, **extra) -> None:
        self.telemetry.events.emit(t, event, request_id=request.id, job=request.job, model=request.state_id,
                                   fn=request.fn, device=device, node=self.node, **extra)

    def summary(self) -> dict:
        out = self.telemetry.summary()
        out["recovery"] = dict(self.recovery)
        with self.sm.lock:
            out["residency"] = {sid: f"device:{s.device}" if s.tier is Tier.DEVICE else s.tier.value
                                for sid, s in self.sm.states.items()}
        return out

    def events(self, job: str | None = None) -> list[dict]:
        return job_events(self.telemetry.events.snapshot(), job)

    def where(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def state_ids(self) -> list[str]:
        with self.sm.lock:
            return sorted(self.sm.states)

    def close(self) -> None:
        self.group.close()
        for thread in self._dispatchers:
            thread.join(timeout=60)
        self.buffers.release_all()
