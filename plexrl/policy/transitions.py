"""Transition planning: which states to move so that one state becomes device-resident.

Invariants (tested in tests/test_policy_transitions.py):
- a plan never places more bytes on a device than its capacity, nor more host buffers than the
  host capacity;
- busy states (claimed by an in-flight request) are never moved;
- a state already resident on the target device needs no transition.

How victims are chosen ("least valuable first"): a state with no queued request is worth less
than one with work waiting; among equals, moving fewer bytes is better, then the state used
longest ago goes first. On the device, victims must form one contiguous window of the arena
(states are contiguous arena regions, so no allocation happens on the switch path).
"""

from __future__ import annotations

from dataclasses import replace

from plexrl.policy.types import (
    LoadPlan,
    NoFit,
    ResidencyView,
    StateInfo,
    Tier,
    Transition,
    TransitionKind,
)


def victim_value(state: StateInfo) -> tuple[int, float]:
    """Lower is evicted first: (has queued work, last use)."""
    return (1 if state.pending else 0, state.last_used_s)


def plan_load(view: ResidencyView, state_id: str, device: int) -> LoadPlan | NoFit:
    state = view.states[state_id]
    capacity = view.device_capacity[device]
    if state.device_bytes > capacity:
        return NoFit(
            f"state {state_id} needs {state.device_bytes} device bytes but device {device} "
            f"has a budget of {capacity}"
        )
    if state.tier is Tier.DEVICE and state.device == device:
        return LoadPlan(state_id, device, state.offset or 0)

    steps: list[Transition] = []
    if state.tier is Tier.DEVICE:
        steps.append(Transition(TransitionKind.OFFLOAD, state_id, state.device_bytes, state.device))
    elif state.tier is Tier.DISK:
        spills = plan_host_room(view, state.host_bytes, exclude={state_id})
        if isinstance(spills, NoFit):
            return spills
        steps.extend(spills)
        steps.append(Transition(TransitionKind.RESTORE, state_id, state.host_bytes))
        view = after(view, spills)

    window = choose_window(view, device, state.device_bytes, exclude=state_id)
    if window is None:
        return NoFit(
            f"device {device} has no room for state {state_id} ({state.device_bytes} bytes): "
            "the states resident there are busy"
        )
    offset, victims = window
    for victim in victims:
        steps.append(Transition(TransitionKind.OFFLOAD, victim.state_id, victim.device_bytes, device))
    steps.append(Transition(TransitionKind.LOAD, state_id, state.device_bytes, device, offset))
    return LoadPlan(state_id, device, offset, tuple(steps))


def after(view: ResidencyView, transitions: "list[Transition] | tuple[Transition, ...]") -> ResidencyView:
    """The view once `transitions` (offloads, spills, restores, loads) have run."""
    tiers = {TransitionKind.OFFLOAD: Tier.HOST, TransitionKind.SPILL: Tier.DISK, TransitionKind.RESTORE: Tier.HOST}
    states = dict(view.states)
    for t in transitions:
        if t.kind in tiers:
            states[t.state_id] = replace(states[t.state_id], tier=tiers[t.kind], device=None, offset=None)
        elif t.kind is TransitionKind.LOAD:
            states[t.state_id] = replace(states[t.state_id], tier=Tier.DEVICE, device=t.device, offset=t.offset)
    return ResidencyView(states, view.device_capacity, view.host_capacity)


def plan_prefetch(view: ResidencyView, state_id: str, device: int, running: LoadPlan) -> LoadPlan | None:
    """A load of `state_id` onto `device` that can run while `running` (claimed, not yet run)
    does: planned on the view as `running` leaves it, with only the steps a device takes — the
    state is idle in host memory, and its victims are idle states of `device` (the window that
    dispatching it next would take anyway). None when there is no such plan: a prefetch is
    never a reason to spill, restore or move a state off another device."""
    state = view.states.get(state_id)
    if state is None or state.busy or state.tier is not Tier.HOST:
        return None
    plan = plan_load(after(view, running.transitions), state_id, device)
    if isinstance(plan, NoFit) or not plan.is_switch:
        return None
    if any(t.kind not in (TransitionKind.OFFLOAD, TransitionKind.LOAD) for t in plan.transitions):
        return None
    return plan


def choose_window(
    view: ResidencyView, device: int, need: int, exclude: str | None = None
) -> tuple[int, list[StateInfo]] | None:
    """The cheapest contiguous arena window of `need` bytes: (offset, states to evict)."""
    capacity = view.device_capacity[device]
    resident = [s for s in view.on_device(device) if s.state_id != exclude]
    # Candidate windows start at 0 or right after a resident region.
    starts = sorted({0, *((s.offset or 0) + s.device_bytes for s in resident)})
    best: tuple[tuple, int, list[StateInfo]] | None = None
    for start in starts:
        end = start + need
        if end > capacity:
            continue
        victims = [s for s in resident if (s.offset or 0) < end and (s.offset or 0) + s.device_bytes > start]
        if any(v.busy for v in victims):
            continue
        cost = (
            sum(1 for v in victims if v.pending),
            sum(v.device_bytes for v in victims),
            max((v.last_used_s for v in victims), default=float("-inf")),
            start,
        )
        if best is None or cost < best[0]:
            best = (cost, start, victims)
    if best is None:
        return None
    return best[1], best[2]


def plan_host_room(view: ResidencyView, need: int, exclude: frozenset[str] | set[str] = frozenset()) -> list[Transition] | NoFit:
    """Transitions that free `need` bytes of host capacity, least valuable first.

    Host-only states are spilled first; an idle device-resident state (whose persistent host
    buffer also counts) is offloaded and then spilled only when that is not enough. A state
    without host bytes of its own (a read replica, whose host copy is its primary's) frees
    nothing by spilling and is never a victim.
    """
    free = view.host_capacity - view.host_used()
    if need <= free:
        return []
    candidates = sorted(
        (s for s in view.states.values()
         if s.tier is not Tier.DISK and not s.busy and s.host_bytes and s.state_id not in exclude),
        key=lambda s: (s.tier is Tier.DEVICE, *victim_value(s)),
    )
    spills = []
    for victim in candidates:
        if free >= need:
            break
        if victim.tier is Tier.DEVICE:
            spills.append(Transition(TransitionKind.OFFLOAD, victim.state_id, victim.device_bytes, victim.device))
        spills.append(Transition(TransitionKind.SPILL, victim.state_id, victim.host_bytes))
        free += victim.host_bytes
    if free < need:
        return NoFit(
            f"host memory budget of {view.host_capacity} bytes cannot hold another {need} bytes "
            f"({view.host_capacity - view.host_used()} free after spilling every idle state)"
        )
    return spills
