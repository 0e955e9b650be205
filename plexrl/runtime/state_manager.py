"""The StateManager of one node: where every model state lives and how it moves (docs/design.md §4).

Invariants (tests/test_runtime_invariants.py):
- the bytes resident in a device arena never exceed its budget, and the host buffers of states
  not on DISK never exceed the node's host budget;
- a state is moved only while claimed (`busy`) by the one thread moving it;
- every transition is timed and recorded (event log, ledger, bandwidth estimate).

Shared LoRA bases: a LoRA state's own bytes are its adapter's; the frozen base it stands on is one
copy per device (a worker's template) and one per node (the node's own), whatever the number of
LoRA states of that base. While a node holds any LoRA state of a base, that base's bytes are
taken off every device's budget and off the host budget, once (`NodeBudgets.shared_bytes`): the planner
never hands those arena bytes out, so admission and switching stay honest.

A device's budget (device_memory_bytes) is everything PlexRL may use on it. States get what is
left (`BesideStates`, budgets.py): budget - the activation reserve of the largest model the node
hosts (measured per base model folder, runtime/activation.py: one function runs at a time per
device) - the vLLM engines' shares (one engine per base model sampled on vLLM, on any device) - the shared LoRA bases.
That net figure is every device's capacity in the policy's view (`plan_load`), and the size the
node gives its workers' arenas (`NodeBudgets.arena_bytes`; node_models.py resizes them when it changes, dropping
device copies first), so the memory beside the arena really is free on CUDA.

Read replicas: a weights-only state that samples with the hf backend (a sampler snapshot, a frozen
reference or teacher; not LoRA) may have up to devices - 1 replicas, `PRIMARY#k`, so that its
calls run on several devices at once (the group scheduler hands them out, scheduler.py). A
replica is a state of its own in every device-side respect (a load, an arena region, a victim
like any clean state) whose host copy is its primary's: no host bytes of its own, never spilled,
removed with its primary. Only functions that change nothing run on one, and only between
calls that change nothing on the primary; while a replica holds or waits for a call its primary
is busy in the policy's view (not spilled, not moved) and takes no node function.

Decisions (what to move) come from `plexrl.policy.transitions`; this module applies them.
All bookkeeping happens under `lock`, the node's one lock (a condition: waiters are woken when
states are released), which the node makes and shares with its group scheduler. Other pieces
look a state up with `state` or `find` and ask the table (`states`, state_table.py) its questions;
read replicas are `replicas` (read_replicas.py).
Host-side transitions (spill, restore) run here, under the lock, so that two planners never count
the same free host bytes. Device-side copies (load, offload) run on the device's worker
(device_worker.py), on states claimed busy; the node books them here (`record`).

Host buffers are files in the node's shared-memory folder (host_buffers.py), so that a worker in
another process maps the same memory; spill files are `spills` (spill_files.py).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import torch

from plexrl.api import errors
from plexrl.backends import slot_decode
from plexrl.policy import (LoadPlan, NoFit, ResidencyView, StateInfo, Tier, Transition, TransitionKind,
                           plan_host_room, plan_load, plan_prefetch)
from plexrl.runtime.arena import DeviceArena
from plexrl.runtime.budgets import NodeBudgets
from plexrl.runtime.host_buffers import SharedHostBuffers
from plexrl.runtime.read_replicas import Pending, ReadReplicas
from plexrl.runtime.spill_files import SpillFiles
from plexrl.runtime.state import ModelState
from plexrl.runtime.state_table import StateTable
from plexrl.runtime.telemetry import Telemetry

HOST_SIDE = (TransitionKind.SPILL, TransitionKind.RESTORE)


def host_side_end(plan: LoadPlan) -> int:
    """Steps before this index make host room or restore (run under the lock, in `prepare`)."""
    if not plan.transitions:
        return 0
    kinds = [t.kind for t in plan.transitions]
    return max((i + 1 for i, k in enumerate(kinds) if k in HOST_SIDE), default=0)


class StateManager:
    def __init__(
        self,
        node: int,
        arenas: dict[int, DeviceArena],
        host_capacity: int,
        spill_dir: Path,
        telemetry: Telemetry,
        buffers: SharedHostBuffers,
        lock: threading.Condition,
        drop_copies: Callable[[str], None] = lambda state_id: None,
    ):
        """`arenas`: the devices' budgets (the arenas themselves are the workers'); `lock`:
        the node's lock, notified when states are released; `drop_copies(state_id)`: tell
        the workers to let go of a state's device copy and host mapping (it is being spilled)."""
        self.node = node
        self.arenas = arenas
        self.host_capacity = host_capacity
        self.spills = SpillFiles(Path(spill_dir))
        self.telemetry = telemetry
        self.buffers = buffers
        self.states = StateTable()
        self.lock = lock
        self._drop_copies = drop_copies
        self.budgets = NodeBudgets(self.states, arenas, host_capacity)
        self.replicas = ReadReplicas(self.states, telemetry, node)

    # -- the table of states ----------------------------------------------------------------
    def state(self, state_id: str) -> ModelState:
        """The state `state_id` (KeyError when the node has none of that name)."""
        return self.states[state_id]

    def find(self, state_id: str) -> ModelState | None:
        return self.states.get(state_id)

    # -- views for the policy ------------------------------------------------------------
    def info(self, s: ModelState, pending: Pending) -> StateInfo:
        return StateInfo(
            state_id=s.state_id, job=s.job, device_bytes=s.device_bytes,
            host_bytes=0 if s.replica_of else s.host_bytes, tier=s.tier, device=s.device, offset=s.offset,
            busy=s.busy or self.replicas.in_use(s.state_id, pending),
            pending=pending(s.state_id), last_used_s=s.last_used_s,
        )

    def view(self, pending: Pending, only: ModelState | None = None) -> ResidencyView:
        """Each device's capacity: the net budget (`arena_bytes`), never more than its arena has
        now (the node resizes arenas after the states it hosts change). `only`: the view of that
        state alone (a plan for a state resident on the device asked for reads nothing else; the
        dispatcher's common case, without building every state's info)."""
        beside = self.budgets.beside()
        net = self.budgets.budget() - beside.total
        states = {only.state_id: only} if only is not None else self.states
        return ResidencyView(
            states={sid: self.info(s, pending) for sid, s in states.items()},
            device_capacity={d: min(a.capacity_bytes, net) for d, a in self.arenas.items()},
            host_capacity=self.host_capacity - beside.shared_bytes,
        )

    def decode_positions(self, state_id: str) -> int:
        """The KV-cache positions a batched sample of the state may hold on a device: the activation
        reserve every device keeps (one function runs at a time, and its slot cache is the bulk of
        a decode's memory) over the bytes of one position of the state's model at the dtype it
        computes in."""
        state = self.states[state_id]
        dtype = state.autocast or state.dtype
        return self.budgets.beside().reserve_bytes // slot_decode.kv_bytes_per_position(state.module.config, dtype)

    # -- adding and removing states -------------------------------------------------------
    def add(self, state: ModelState, pending: Pending, initial: torch.Tensor | None = None,
            holding: frozenset[str] = frozenset()) -> None:
        """Register a state and give it its persistent host buffer, filled from its module
        (or from `initial`, a flat weights tensor). When host room is short only because states
        are in use, wait for them — except the ones the caller itself `holding`s."""
        self.budgets.check_fits(state)
        with self.lock:
            if state.state_id in self.states:
                raise errors.InvalidInput(f"a model named {state.name!r} already exists in job {state.job!r}")
            # a new base takes host room too
            need = state.host_bytes + self.budgets.shared_bytes(state) - self.budgets.shared_bytes()
            room = plan_host_room(self.view(pending), need)
            while isinstance(room, NoFit) and any(s.busy and s.state_id not in holding for s in self.states.values()):
                self.lock.wait(0.05)  # states in use now free their host buffers when released
                room = plan_host_room(self.view(pending), need)
            if isinstance(room, NoFit):
                raise errors.StateTooLarge(f"cannot add model {state.name!r} of job {state.job!r}: {room.reason}")
            for t in room:
                self._run(t, state.job)
            host = self.buffers.allocate(state.host_bytes)
            weights = state.segment(host, 0)
            if initial is not None:
                weights.copy_(initial)
            else:
                torch.cat([p.detach().reshape(-1) for p in state.params], out=weights)
            state.typed(host)[state.numel :].zero_()  # gradients and Adam moments start at zero
            state.host = host
            state.tier = Tier.HOST
            state.bind(host)
            self.states[state.state_id] = state
            self.telemetry.events.emit(self.telemetry.now(), "state_added", state=state.state_id, job=state.job,
                                       node=self.node, host_bytes=state.host_bytes, device_bytes=state.device_bytes)

    def in_use(self, state_id: str, pending: Pending) -> bool:
        """Under the lock: whether the state or one of its replicas is claimed or has calls queued."""
        return self.states[state_id].busy or bool(pending(state_id)) or self.replicas.in_use(state_id, pending)

    def host_copy_changed(self, state: ModelState) -> None:
        """Its host copy was rewritten (a node function, an in-place sync): its device copy and
        its replicas' are stale; the next use of each loads it again."""
        self.forget_device_copy(state)
        self.drop_replica_copies(state.state_id)

    def drop_replica_copies(self, state_id: str) -> None:
        """Its host copy changes or goes (rewritten, spilled): its replicas' device copies and the
        workers' mappings go first."""
        for replica in self.replicas.of(state_id):
            self._drop_copies(replica)
            self.forget_device_copy(self.states[replica])

    def remove(self, state_id: str) -> list[str]:
        """Remove a state and its read replicas; returns the ids removed (the state's last)."""
        with self.lock:
            gone = [*self.replicas.forget(state_id), state_id]
            for sid in gone:
                state = self.states.pop(sid)
                if not state.replica_of:  # a replica's module and host copy are its primary's
                    self.buffers.release(state.host)
                    state.unbind()
                    state.host = None
                    state._resident = None
                if state.spill_path is not None:
                    state.spill_path.unlink(missing_ok=True)
                self.telemetry.events.emit(self.telemetry.now(), "state_removed", state=sid, job=state.job,
                                           node=self.node, tier=state.tier.value,
                                           host_bytes=0 if state.replica_of else state.host_bytes,
                                           device=state.device, device_bytes=state.device_bytes)
            return gone

    # -- planning ---------------------------------------------------------------------------
    def prepare(self, state_id: str, device: int | None, job: str, pending: Pending) -> LoadPlan | NoFit:
        """Under the lock: plan making `state_id` usable (resident on `device`, or at least in host
        memory when `device` is None), run its host-side steps, and claim every state the
        remaining device-side steps touch. The caller runs `apply(plan)` then `release(plan)`."""
        state = self.states[state_id]
        if device is None:
            plan: LoadPlan | NoFit = LoadPlan(state_id, -1, -1)
            if state.tier is Tier.DISK:
                room = plan_host_room(self.view(pending), state.host_bytes, exclude={state_id})
                if isinstance(room, NoFit):
                    return room
                plan = LoadPlan(state_id, -1, -1, (*room, Transition(TransitionKind.RESTORE, state_id, state.host_bytes)))
        else:
            resident = state.tier is Tier.DEVICE and state.device == device  # plan_load then reads it alone
            plan = plan_load(self.view(pending, only=state if resident else None), state_id, device)
        if isinstance(plan, NoFit):
            return plan
        for t in plan.transitions[: host_side_end(plan)]:
            self._run(t, job)
        state.busy = True
        for t in plan.transitions[host_side_end(plan):]:
            if t.kind is TransitionKind.OFFLOAD:
                self.states[t.state_id].busy = True
        return plan

    def prepare_prefetch(self, state_id: str, device: int, running: LoadPlan, pending: Pending) -> LoadPlan | None:
        """Under the lock, right after `prepare(running)`: plan loading `state_id` onto `device`
        while `running`'s function runs there (policy.plan_prefetch says when that is allowed)
        and claim what the plan touches, as `prepare` does. The caller runs it with `running`
        and `release`s it. Only states a worker loads from its host copy as it is (hf samplers:
        a vLLM engine holds one snapshot at a time, so its push cannot overlap its own calls)."""
        state = self.states.get(state_id)
        if state is None or state.sampler != "hf":
            return None
        plan = plan_prefetch(self.view(pending), state_id, device, running)
        if plan is None:
            return None
        for t in plan.transitions:
            self.states[t.state_id].busy = True
        return plan

    def device_steps(self, plan: LoadPlan) -> tuple[Transition, ...]:
        """The steps a worker runs (loads and offloads), after `prepare` ran the host-side ones."""
        return plan.transitions[host_side_end(plan):]

    def release(self, plan: LoadPlan, now: float) -> None:
        with self.lock:
            for t in plan.transitions[host_side_end(plan):]:
                if t.kind is TransitionKind.OFFLOAD and t.state_id != plan.state_id:
                    self.states[t.state_id].busy = False
            state = self.states.get(plan.state_id)
            if state is not None:
                state.busy = False
                state.last_used_s = now
            self.lock.notify_all()

    def let_go(self, offloads) -> None:
        """Under the lock: the victims of these `offloads` (of a plan being dispatched) are in host
        memory and unclaimed now, before the worker ran them (their device copies are clean)."""
        for t in offloads:
            self.moved(t)
            self.states[t.state_id].busy = False
        self.lock.notify_all()

    # -- transitions --------------------------------------------------------------------------
    def _run(self, t: Transition, job: str) -> float:
        state = self.states[t.state_id]
        start = self.telemetry.now()
        t0 = time.perf_counter()
        moved = getattr(self, "_" + t.kind.value)(state, t)
        seconds = time.perf_counter() - t0
        self.telemetry.transition(t, job, moved, seconds, self.node, start, t.bytes)
        return seconds

    def _offload(self, state: ModelState, t: Transition) -> int:
        """Host-side plans offload before they spill: the host copy is current (write-through),
        so nothing moves; the spill that follows makes the workers let go."""
        self.forget_device_copy(state, logged=False)
        return 0

    def _spill(self, state: ModelState, t: Transition) -> int:
        self.drop_replica_copies(state.state_id)
        self._drop_copies(state.state_id)  # a worker's mapping would keep the freed host memory alive
        state.spill_path = self.spills.write(state)
        state.unbind()
        self.buffers.release(state.host)
        state.host = None
        state.tier = Tier.DISK
        return state.host_bytes

    def _restore(self, state: ModelState, t: Transition) -> int:
        """Read the spill file back (SpillFiles.read: an unreadable one fails the caller's request
        and changes nothing else)."""
        host = self.buffers.allocate(state.host_bytes)
        try:
            self.spills.read(state, host)
        except errors.StateLost:
            self.buffers.release(host)
            raise
        state.spill_path.unlink(missing_ok=True)
        state.spill_path = None
        state.host = host
        state.tier = Tier.HOST
        state.bind(host)
        return state.host_bytes

    def materialize(self, state: ModelState, job: str, write: Callable[[], int]) -> None:
        """Time and record a snapshot written by `write` (which returns the bytes it wrote)."""
        start = self.telemetry.now()
        t0 = time.perf_counter()
        nbytes = write()
        t = Transition(TransitionKind.MATERIALIZE, state.state_id, nbytes)
        self.telemetry.transition(t, job, nbytes, time.perf_counter() - t0, self.node, start)

    # -- what workers report -------------------------------------------------------------------
    def record(self, t: Transition, job: str, seconds: float, start: float, moved: int,
               charged_s: float | None = None) -> None:
        """Book a device-side transition a worker ran (the state is claimed busy by the plan).
        The node's own view of a DEVICE state stays bound to its host copy, which write-through
        keeps current: node functions read and write that."""
        self.moved(t)
        self.book(t, job, seconds, start, moved, charged_s)

    def book(self, t: Transition, job: str, seconds: float, start: float, moved: int,
             charged_s: float | None = None) -> None:
        """Charge a device-side transition to `job` and log it (`record` without the view)."""
        self.telemetry.transition(t, job, moved, seconds, self.node, start, t.bytes, charged_s)

    def moved(self, t: Transition) -> None:
        """The node's view follows a device-side transition (`record` without the booking: an
        offload elsewhere is booked when its worker answers, step_runner.py)."""
        state = self.states[t.state_id]
        with self.lock:
            if t.kind is TransitionKind.LOAD:
                state.tier, state.device, state.offset = Tier.DEVICE, t.device, t.offset
            else:
                state.tier, state.device, state.offset = Tier.HOST, None, None
            state.dirty = False

    def lose_device(self, device: int) -> list[str]:
        """The device's copies are gone (its worker died, or a node function changed the host
        copy): every state resident there is back to its host copy."""
        with self.lock:
            lost = self.states.resident_on((device,))
            for state in lost:
                self.forget_device_copy(state)
            self.lock.notify_all()
        return [s.state_id for s in lost]

    def forget_device_copy(self, state: ModelState, logged: bool = True) -> None:
        """`state`'s device copy is stale (or gone): the next use loads it again. Logged as an
        offload that moved nothing, so that the event log's residency stays whole."""
        with self.lock:
            if state.tier is not Tier.DEVICE:
                return
            if logged:
                t = Transition(TransitionKind.OFFLOAD, state.state_id, state.device_bytes, state.device)
                self.telemetry.transition(t, state.job, 0, 0.0, self.node, self.telemetry.now(), state.device_bytes)
            state.tier, state.device, state.offset, state.dirty = Tier.HOST, None, None, False
