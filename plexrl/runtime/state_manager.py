"""The StateManager of one node: where every model state lives and how it moves (DESIGN §4).

Invariants (tests/test_runtime_invariants.py):
- the bytes resident in a device arena never exceed its budget, and the host buffers of states
  not on DISK never exceed the node's host budget;
- a state is moved only while claimed (`busy`) by the one thread moving it;
- every transition is timed and recorded (event log, ledger, bandwidth estimate).

Shared LoRA bases: a LoRA state's own bytes are its adapter's; the frozen base it stands on is one
copy per device (a worker's template) and one per node (the node's own), whatever the number of
LoRA states of that base. While a node holds any LoRA state of a base, that base's bytes are
taken off every device's budget and off the host budget, once (`shared_bytes`): the planner
never hands those arena bytes out, so admission and switching stay honest.

Decisions (what to move) come from `plexrl.policy.transitions`; this module applies them.
All bookkeeping happens under `lock`, which the node's group scheduler shares (the node makes it).
Host-side transitions (spill, restore) run here, under the lock, so that two planners never count
the same free host bytes. Device-side copies (load, offload) run on the device's worker
(device_worker.py), on states claimed busy; the node books them here (`record`).

Host buffers are files in the node's shared-memory folder (host_buffers.py), so that a worker in
another process maps the same memory; spill files have opaque names of their own, so no two
states' names can make them collide.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from plexrl.api import errors
from plexrl.policy import (
    LoadPlan,
    NoFit,
    ResidencyView,
    StateInfo,
    Tier,
    Transition,
    TransitionKind,
    plan_host_room,
    plan_load,
)
from plexrl.runtime.arena import DeviceArena
from plexrl.runtime.host_buffers import SharedHostBuffers
from plexrl.runtime.state import ModelState
from plexrl.runtime.telemetry import Telemetry

Pending = Callable[[str], int]  # queued calls per state (the group scheduler's), for victim choice

HOST_SIDE = (TransitionKind.SPILL, TransitionKind.RESTORE)


def host_side_end(plan: LoadPlan) -> int:
    """Steps before this index make host room or restore (run under the lock, in `prepare`)."""
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
        changed: threading.Condition,
        drop_copies: Callable[[str], None] = lambda state_id: None,
    ):
        """`arenas`: the devices' budgets (the arenas themselves are the workers'); `changed`:
        the node's condition, notified when states are released; `drop_copies(state_id)`: tell
        the workers to let go of a state's device copy and host mapping (it is being spilled)."""
        self.node = node
        self.arenas = arenas
        self.host_capacity = host_capacity
        self.spill_dir = Path(spill_dir)
        self.telemetry = telemetry
        self.buffers = buffers
        self.states: dict[str, ModelState] = {}
        self.changed = changed
        self.lock = changed
        self._spill_ids = itertools.count()
        self._drop_copies = drop_copies

    # -- views for the policy ------------------------------------------------------------
    def info(self, s: ModelState, pending: Pending) -> StateInfo:
        return StateInfo(
            state_id=s.state_id, job=s.job, device_bytes=s.device_bytes, host_bytes=s.host_bytes,
            tier=s.tier, device=s.device, offset=s.offset, busy=s.busy,
            pending=pending(s.state_id), last_used_s=s.last_used_s,
        )

    def view(self, pending: Pending) -> ResidencyView:
        shared = self.shared_bytes()
        return ResidencyView(
            states={sid: self.info(s, pending) for sid, s in self.states.items()},
            device_capacity={d: a.capacity_bytes - shared for d, a in self.arenas.items()},
            host_capacity=self.host_capacity - shared,
        )

    def shared_bytes(self, adding: ModelState | None = None) -> int:
        """Bytes of the shared LoRA bases the node's states stand on (and `adding`'s), each counted once."""
        states = [*self.states.values(), *([adding] if adding is not None else [])]
        return sum({s.source: s.shared_bytes for s in states if s.lora is not None}.values())

    def resident_bytes(self, device: int) -> int:
        return sum(s.device_bytes for s in self.states.values() if s.tier is Tier.DEVICE and s.device == device)

    # -- adding and removing states -------------------------------------------------------
    def add(self, state: ModelState, pending: Pending, initial: torch.Tensor | None = None,
            holding: frozenset[str] = frozenset()) -> None:
        """Register a state and give it its persistent host buffer, filled from its module
        (or from `initial`, a flat weights tensor). When host room is short only because states
        are in use, wait for them — except the ones the caller itself `holding`s."""
        self.check_fits(state)
        with self.lock:
            if state.state_id in self.states:
                raise errors.InvalidInput(f"a model named {state.name!r} already exists in job {state.job!r}")
            need = state.host_bytes + self.shared_bytes(state) - self.shared_bytes()  # a new base takes host room too
            room = plan_host_room(self.view(pending), need)
            while isinstance(room, NoFit) and any(s.busy and s.state_id not in holding for s in self.states.values()):
                self.changed.wait(0.05)  # states in use now free their host buffers when released
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
            host[state.numel :].zero_()  # gradients and Adam moments start at zero
            state.host = host
            state.tier = Tier.HOST
            state.bind(host)
            self.states[state.state_id] = state
            self._make_room_for_shared()
            self.telemetry.events.emit(self.telemetry.now(), "state_added", state=state.state_id, job=state.job,
                                       node=self.node, host_bytes=state.host_bytes, device_bytes=state.device_bytes)

    def check_fits(self, state: ModelState) -> None:
        """StateTooLarge unless the state fits this node's budgets when nothing but the shared
        bases (its own included) is there."""
        smallest = min(a.capacity_bytes for a in self.arenas.values())
        shared = self.shared_bytes(state)
        check_budgets(state.name, state.job, state.trainable, state.device_bytes, state.host_bytes, smallest,
                      self.host_capacity, shared)
        largest = max(self.states.values(), key=lambda s: s.device_bytes, default=None)
        if largest is not None and shared > self.shared_bytes() and largest.device_bytes + shared > smallest:
            raise errors.StateTooLarge(
                f"cannot add LoRA model {state.name!r} of job {state.job!r}: its base's {state.shared_bytes:,} bytes "
                f"would leave a device budget of {smallest - shared:,} bytes, too small for model {largest.name!r} of "
                f"job {largest.job!r} ({largest.device_bytes:,} bytes); expected device_memory_bytes >= "
                f"{largest.device_bytes + shared:,}")

    def _make_room_for_shared(self) -> None:
        """A base just taken off the budgets: idle states resident beyond the smaller device budget
        drop their device copies (write-through keeps their host copies current; they load again
        below the line: check_fits made sure every state still fits it)."""
        shared = self.shared_bytes()
        for s in self.states.values():
            if s.tier is Tier.DEVICE and not s.busy and s.offset + s.device_bytes > self.arenas[s.device].capacity_bytes - shared:
                self.forget_device_copy(s)

    def remove(self, state_id: str) -> None:
        with self.lock:
            state = self.states.pop(state_id)
            self.buffers.release(state.host)
            state.unbind()
            state.host = None
            state._resident = None
            if state.spill_path is not None:
                state.spill_path.unlink(missing_ok=True)
            self.telemetry.events.emit(self.telemetry.now(), "state_removed", state=state_id, job=state.job,
                                       node=self.node, tier=state.tier.value, host_bytes=state.host_bytes,
                                       device=state.device, device_bytes=state.device_bytes)

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
            plan = plan_load(self.view(pending), state_id, device)
        if isinstance(plan, NoFit):
            return plan
        for t in plan.transitions[: host_side_end(plan)]:
            self._run(t, job)
        state.busy = True
        for t in plan.transitions[host_side_end(plan):]:
            if t.kind is TransitionKind.OFFLOAD:
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
            self.changed.notify_all()

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
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        self._drop_copies(state.state_id)  # a worker's mapping would keep the freed host memory alive
        path = self.spill_dir / f"spill-{next(self._spill_ids)}.safetensors"  # opaque: no name can alias
        save_file({"flat": state.host}, str(path), metadata={"state": state.state_id, "adam_step": str(state.adam_step)})
        state.spill_path = path
        state.unbind()
        self.buffers.release(state.host)
        state.host = None
        state.tier = Tier.DISK
        return state.host_bytes

    def _restore(self, state: ModelState, t: Transition) -> int:
        """Read the spill file back. An unreadable one marks the state `unreadable` (the caller's
        request fails; nothing else changes); an unreadable state comes back zeroed, for the
        checkpoint load that revives it to fill."""
        host = self.buffers.allocate(state.host_bytes)
        try:
            if state.unreadable:
                host.zero_()
            else:
                host.copy_(load_file(str(state.spill_path))["flat"])
        except Exception as exc:
            self.buffers.release(host)
            state.unreadable = True
            raise errors.StateLost(
                f"model {state.state_id!r} could not be read back from its spill file ({type(exc).__name__}: {exc}); "
                "restore it from a checkpoint with load_state_with_optimizer(path) (load_state for weights only) "
                "before using it") from exc
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
    def record(self, t: Transition, job: str, seconds: float, start: float, moved: int) -> None:
        """Book a device-side transition a worker ran (the state is claimed busy by the plan).
        The node's own view of a DEVICE state stays bound to its host copy, which write-through
        keeps current: node functions read and write that."""
        state = self.states[t.state_id]
        with self.lock:
            if t.kind is TransitionKind.LOAD:
                state.tier, state.device, state.offset = Tier.DEVICE, t.device, t.offset
            else:
                state.tier, state.device, state.offset = Tier.HOST, None, None
            state.dirty = False
        self.telemetry.transition(t, job, moved, seconds, self.node, start, t.bytes)

    def lose_device(self, device: int) -> list[str]:
        """The device's copies are gone (its worker died, or a node function changed the host
        copy): every state resident there is back to its host copy."""
        with self.lock:
            lost = [s for s in self.states.values() if s.tier is Tier.DEVICE and s.device == device]
            for state in lost:
                self.forget_device_copy(state)
            self.changed.notify_all()
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


def check_budgets(name: str, job: str, trainable: bool, device_bytes: int, host_bytes: int, device_budget: int,
                  host_budget: int, shared_bytes: int = 0) -> None:
    """StateTooLarge unless a state of these sizes fits the budgets when nothing else is there
    but `shared_bytes` of shared LoRA bases (counted once on each budget)."""
    what = ("weights, gradients and Adam moments" if trainable else "weights") + ", float32"
    if shared_bytes:
        what += f", next to {shared_bytes:,} bytes of shared frozen LoRA base weights"
    if device_bytes + shared_bytes > device_budget:
        raise errors.StateTooLarge(
            f"model {name!r} of job {job!r} needs {device_bytes + shared_bytes:,} device bytes ({what}) but a "
            f"device budget is {device_budget:,} bytes; expected device_memory_bytes >= {device_bytes + shared_bytes:,}"
        )
    if host_bytes + shared_bytes > host_budget:
        raise errors.StateTooLarge(
            f"model {name!r} of job {job!r} needs {host_bytes + shared_bytes:,} host bytes but the "
            f"node's host budget is {host_budget:,}; expected host_memory_bytes >= {host_bytes + shared_bytes:,}"
        )
