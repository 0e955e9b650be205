"""The read replicas of a node's weights-only states (state_manager.py's docstring says what one is).

A replica `PRIMARY#k` is registered in the StateManager's table beside its primary (it moves like
any state) and listed here under its primary, in the order made; this module answers which state
a replica stands for, where its host copy is, and whether one is in use or free for a call.

Invariants: a replica is made only of a replicable primary (not trainable, not LoRA, sampled with
hf, not on DISK), never of a replica; it has no host bytes of its own; it is listed here exactly
while it is in the table. Every method runs under the node's lock.
"""

from __future__ import annotations

from typing import Callable

import torch

from plexrl.policy import Tier
from plexrl.runtime.state import ModelState
from plexrl.runtime.telemetry import Telemetry

Pending = Callable[[str], int]  # queued calls per state (the group scheduler's)


class ReadReplicas:
    def __init__(self, states: dict[str, ModelState], telemetry: Telemetry, node: int):
        """`states`: the StateManager's table, which replicas are entered in."""
        self._states = states
        self._telemetry = telemetry
        self._node = node
        self._of: dict[str, list[str]] = {}  # primary -> its read replicas, in the order made

    @staticmethod
    def replicable(state: ModelState) -> bool:
        return (state.replica_of is None and not state.trainable and state.lora is None and state.sampler == "hf"
                and state.tier is not Tier.DISK)

    def primary_of(self, state_id: str) -> str:
        state = self._states.get(state_id)
        return state.replica_of if state is not None and state.replica_of else state_id

    def host_of(self, state: ModelState) -> torch.Tensor | None:
        """The host copy a state loads from: its own, or a replica's primary's."""
        return self._states[state.replica_of].host if state.replica_of else state.host

    def of(self, state_id: str) -> list[str]:
        """The replicas of `state_id` (none for a state that has none)."""
        return self._of.get(state_id, [])

    def in_use(self, state_id: str, pending: Pending) -> bool:
        """Whether a replica of `state_id` is claimed or has calls queued."""
        return any(self._states[r].busy or pending(r) for r in self._of.get(state_id, ()))

    def idle(self, state_id: str, pending: Pending, most: int) -> str | None:
        """A replica of `state_id` with no call queued, made when fewer than `most` exist; None
        when every one has a call. Prefers one resident on a device."""
        mine = self._of.setdefault(state_id, [])
        idle = [r for r in mine if not pending(r)]
        if idle:
            return min(idle, key=lambda r: self._states[r].tier is not Tier.DEVICE)
        if len(mine) >= most:
            return None
        primary = self._states[state_id]
        replica = ModelState(f"{state_id}#{len(mine) + 1}", primary.job, f"{primary.name}#{len(mine) + 1}",
                             primary.module, False, primary.source, dtype=primary.dtype, autocast=primary.autocast,
                             replica_of=state_id)
        self._states[replica.state_id] = replica
        mine.append(replica.state_id)
        self._telemetry.events.emit(self._telemetry.now(), "state_added", state=replica.state_id, job=replica.job,
                                    node=self._node, host_bytes=0, device_bytes=replica.device_bytes,
                                    replica_of=state_id)
        return replica.state_id

    def forget(self, state_id: str) -> list[str]:
        """`state_id` goes: its replicas are listed no more; returns them (the caller removes them)."""
        return self._of.pop(state_id, [])
