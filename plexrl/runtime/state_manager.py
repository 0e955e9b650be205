"""The StateManager of one node: where every model state lives and how it moves (DESIGN §4).

Invariants (tests/test_runtime_invariants.py):
- the bytes resident in a device arena never exceed its budget, and the host buffers of states
  not on DISK never exceed the node's host budget;
- a state is moved only while claimed (`busy`) by the one thread moving it;
- every transition is timed and recorded (event log, ledger, bandwidth estimate).

Decisions (what to move) come from `plexrl.policy.transitions`; this module applies them.
All bookkeeping happens under `lock`, which the group schedulers of the node share. Host-side
transitions (spill, restore) run under the lock so that two planners never count the same free
host bytes; device-side copies (load, offload) run outside it, on states claimed busy.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from plexrl import errors
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
from plexrl.runtime.state import ModelState
from plexrl.runtime.telemetry import Telemetry

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
        pin_memory: bool = False,
    ):
        self.node = node
        self.arenas = arenas
        self.host_capacity = host_capacity
        self.spill_dir = Path(spill_dir)
        self.telemetry = telemetry
        self.pin_memory = pin_memory
        self.states: dict[str, ModelState] = {}
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)  # notified when states are released
        self.pending: Callable[[str], int] = lambda state_id: 0  # set by the schedulers

    # -- views for the policy ------------------------------------------------------------
    def info(self, s: ModelState) -> StateInfo:
        return StateInfo(
            state_id=s.state_id, job=s.job, device_bytes=s.device_bytes, host_bytes=s.host_bytes,
            tier=s.tier, device=s.device, offset=s.offset, busy=s.busy,
            pending=self.pending(s.state_id), last_used_s=s.last_used_s,
        )

    def view(self) -> ResidencyView:
        return ResidencyView(
            states={sid: self.info(s) for sid, s in self.states.items()},
            device_capacity={d: a.capacity_bytes for d, a in self.arenas.items()},
            host_capacity=self.host_capacity,
        )

    def resident_bytes(self, device: int) -> int:
        return sum(s.device_bytes for s in self.states.values() if s.tier is Tier.DEVICE and s.device == device)

    # -- adding and removing states -------------------------------------------------------
    def add(self, state: ModelState, initial: torch.Tensor | None = None, holding: frozenset[str] = frozenset()) -> None:
        """Register a state and give it its persistent host buffer, filled from its module
        (or from `initial`, a flat weights tensor). When host room is short only because states
        are in use, wait for them — except the ones the caller itself `holding`s."""
        self.check_fits(state)
        with self.lock:
            if state.state_id in self.states:
                raise errors.InvalidInput(f"a model named {state.name!r} already exists in job {state.job!r}")
            room = plan_host_room(self.view(), state.host_bytes)
            while isinstance(room, NoFit) and any(s.busy and s.state_id not in holding for s in self.states.values()):
                self.changed.wait(0.05)  # states in use now free their host buffers when released
                room = plan_host_room(self.view(), state.host_bytes)
            if isinstance(room, NoFit):
                raise errors.StateTooLarge(f"cannot add model {state.name!r} of job {state.job!r}: {room.reason}")
            for t in room:
                self._run(t, state.job)
            host = self._host_buffer(state.host_bytes)
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
            self.telemetry.events.emit(self.telemetry.now(), "state_added", state=state.state_id, job=state.job,
                                       node=self.node, host_bytes=state.host_bytes, device_bytes=state.device_bytes)

    def check_fits(self, state: ModelState) -> None:
        """StateTooLarge unless the state fits this node's budgets when nothing else is there."""
        smallest = min(a.capacity_bytes for a in self.arenas.values())
        if state.device_bytes > smallest:
            raise errors.StateTooLarge(
                f"model {state.name!r} of job {state.job!r} needs {state.device_bytes:,} device bytes "
                f"({'weights, gradients and Adam moments' if state.trainable else 'weights'}, float32) but a "
                f"device budget is {smallest:,} bytes; expected device_memory_bytes >= {state.device_bytes:,}"
            )
        if state.host_bytes > self.host_capacity:
            raise errors.StateTooLarge(
                f"model {state.name!r} of job {state.job!r} needs {state.host_bytes:,} host bytes but the "
                f"node's host budget is {self.host_capacity:,}; expected host_memory_bytes >= {state.host_bytes:,}"
            )

    def remove(self, state_id: str) -> None:
        with self.lock:
            state = self.states.pop(state_id)
            state.unbind()
            state.host = None
            state._resident = None
            if state.spill_path is not None:
                state.spill_path.unlink(missing_ok=True)
            self.telemetry.events.emit(self.telemetry.now(), "state_removed", state=state_id, job=state.job,
                                       node=self.node, tier=state.tier.value, host_bytes=state.host_bytes,
                                       device=state.device, device_bytes=state.device_bytes)

    # -- migration (a spill here, a restore on the new node) --------------------------------------
    def evict(self, state_id: str, job: str) -> ModelState:
        """Wait until the state is idle, spill it (offloading first if resident) and hand it over;
        its spill file stays for the adopting node to restore from."""
        with self.changed:
            state = self.states[state_id]
            while state.busy or self.pending(state_id):
                self.changed.wait(0.01)
            if state.tier is Tier.DEVICE:
                self._run(Transition(TransitionKind.OFFLOAD, state_id, state.device_bytes, state.device), job)
            if state.tier is Tier.HOST:
                self._run(Transition(TransitionKind.SPILL, state_id, state.host_bytes), job)
            del self.states[state_id]
            self.telemetry.events.emit(self.telemetry.now(), "state_removed", state=state_id, job=state.job,
                                       node=self.node, tier=state.tier.value, host_bytes=state.host_bytes,
                                       device=None, device_bytes=state.device_bytes)
            return state

    def adopt(self, state: ModelState) -> None:
        """Take over a spilled state from another node; it is restored here on first use."""
        with self.lock:
            self.states[state.state_id] = state
            self.telemetry.events.emit(self.telemetry.now(), "state_adopted", state=state.state_id, job=state.job,
                                       node=self.node, tier=state.tier.value, host_bytes=state.host_bytes,
                                       device_bytes=state.device_bytes)

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=self.pin_memory)

    # -- planning ---------------------------------------------------------------------------
    def prepare(self, state_id: str, device: int | None, job: str) -> LoadPlan | NoFit:
        """Under the lock: plan making `state_id` usable (resident on `device`, or at least in host
        memory when `device` is None), run its host-side steps, and claim every state the
        remaining device-side steps touch. The caller runs `apply(plan)` then `release(plan)`."""
        state = self.states[state_id]
        if device is None:
            plan: LoadPlan | NoFit = LoadPlan(state_id, -1, -1)
            if state.tier is Tier.DISK:
                room = plan_host_room(self.view(), state.host_bytes, exclude={state_id})
                if isinstance(room, NoFit):
                    return room
                plan = LoadPlan(state_id, -1, -1, (*room, Transition(TransitionKind.RESTORE, state_id, state.host_bytes)))
        else:
            plan = plan_load(self.view(), state_id, device)
        if isinstance(plan, NoFit):
            return plan
        for t in plan.transitions[: host_side_end(plan)]:
            self._run(t, job)
        state.busy = True
        for t in plan.transitions[host_side_end(plan):]:
            if t.kind is TransitionKind.OFFLOAD:
                self.states[t.state_id].busy = True
        return plan

    def apply(self, plan: LoadPlan, job: str) -> float:
        """Run the device-side steps of a prepared plan; returns the seconds they took."""
        return sum(self._run(t, job) for t in plan.transitions[host_side_end(plan):])

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

    def _load(self, state: ModelState, t: Transition) -> int:
        region = self.arenas[t.device].region(t.offset, state.device_bytes)
        region.copy_(state.host, non_blocking=False)
        state.attach(region, t.device, t.offset)
        state.dirty = False
        return state.device_bytes

    def _offload(self, state: ModelState, t: Transition) -> int:
        moved = 0
        if state.dirty:  # an unchanged state's host buffer is already current: nothing to copy
            state.host.copy_(state.current())
            moved = state.device_bytes
        with self.lock:
            state.detach_to_host()
            state.dirty = False
        return moved

    def _spill(self, state: ModelState, t: Transition) -> int:
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        path = self.spill_dir / f"{state.state_id.replace('/', '__')}.safetensors"
        save_file({"flat": state.host}, str(path), metadata={"state": state.state_id, "adam_step": str(state.adam_step)})
        state.spill_path = path
        state.unbind()
        state.host = None
        state.tier = Tier.DISK
        return state.host_bytes

    def _restore(self, state: ModelState, t: Transition) -> int:
        host = self._host_buffer(state.host_bytes)
        host.copy_(load_file(str(state.spill_path))["flat"])
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
