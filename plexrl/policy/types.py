"""Nouns the policy code decides about. Frozen dataclasses in, frozen dataclasses out.

Everything here is plain data: the runtime and the simulator both build these views of their
own state and apply the decisions they get back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping


class Tier(str, Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class TransitionKind(str, Enum):
    LOAD = "load"  # HOST -> DEVICE
    OFFLOAD = "offload"  # DEVICE -> HOST
    SPILL = "spill"  # HOST -> DISK
    RESTORE = "restore"  # DISK -> HOST
    MATERIALIZE = "materialize"  # snapshot to DISK, residency unchanged


@dataclass(frozen=True, slots=True)
class Transition:
    kind: TransitionKind
    state_id: str
    bytes: int
    device: int | None = None  # the device a LOAD goes to or an OFFLOAD comes from
    offset: int | None = None  # arena offset of a LOAD


@dataclass(frozen=True, slots=True)
class StateInfo:
    """What the policy needs to know about one model state.

    `device_bytes` is what the state occupies in a device arena when resident (weights, and for
    trainable states gradients and optimizer moments); `host_bytes` is its persistent host buffer.
    `busy` states are claimed by an in-flight request and may not be moved; `pending` counts the
    requests queued for the state.
    """

    state_id: str
    job: str
    device_bytes: int
    host_bytes: int
    tier: Tier
    device: int | None = None
    offset: int | None = None
    busy: bool = False
    pending: int = 0
    last_used_s: float = 0.0


@dataclass(frozen=True)
class ResidencyView:
    """States of one node group, each device's arena capacity and the node's host capacity."""

    states: Mapping[str, StateInfo]
    device_capacity: Mapping[int, int]
    host_capacity: int

    def on_device(self, device: int) -> list[StateInfo]:
        return sorted(
            (s for s in self.states.values() if s.tier is Tier.DEVICE and s.device == device),
            key=lambda s: s.offset or 0,
        )

    def host_used(self) -> int:
        return sum(s.host_bytes for s in self.states.values() if s.tier is not Tier.DISK)

    def device_free(self, device: int) -> int:
        return self.device_capacity[device] - sum(s.device_bytes for s in self.on_device(device))


@dataclass(frozen=True)
class LoadPlan:
    """The transitions, in order, that make `state_id` resident on `device` at `offset`."""

    state_id: str
    device: int
    offset: int
    transitions: tuple[Transition, ...] = field(default=())

    @property
    def is_switch(self) -> bool:
        return any(t.kind is TransitionKind.LOAD for t in self.transitions)


@dataclass(frozen=True)
class NoFit:
    """A state cannot be made resident; `reason` names the resource that is short."""

    reason: str
