"""The table of a node's model states (read replicas included), by id, and the questions the
node's pieces ask of it.

The StateManager owns the table and is the only writer (adding, removing, moving states, all
under the node's lock); the node, its group scheduler, its budgets and its read replicas read it
through these questions rather than walking it themselves. A question that copies the table
first (`list(...)`) is one the node asks without holding the lock.
"""

from __future__ import annotations

from plexrl.policy import Tier
from plexrl.runtime.state import ModelState


class StateTable(dict[str, ModelState]):
    def models_of(self, job: str) -> list[str]:
        """The ids of `job`'s states here, read replicas left out."""
        return [sid for sid, s in list(self.items()) if s.job == job and not s.replica_of]

    def hosts_job(self, job: str) -> bool:
        return any(s.job == job for s in list(self.values()))

    def model_ids(self) -> list[str]:
        """The node's states, sorted, read replicas left out."""
        return sorted(sid for sid, s in self.items() if not s.replica_of)

    def stands_on_base(self, source: str) -> bool:
        """Whether a LoRA state here stands on the frozen base of `source`."""
        return any(s.lora is not None and s.source == source for s in list(self.values()))

    def resident_on(self, devices) -> list[ModelState]:
        """The states with a device copy on one of `devices`."""
        return [s for s in self.values() if s.tier is Tier.DEVICE and s.device in devices]

    def resident_bytes(self, device: int) -> int:
        return sum(s.device_bytes for s in self.values() if s.tier is Tier.DEVICE and s.device == device)

    def any_busy(self) -> bool:
        """Whether any state is claimed (in transit or in use)."""
        return any(s.busy for s in self.values())

    def residency(self) -> dict[str, str]:
        """Each state's tier: "device:N", "host" or "disk"."""
        return {sid: f"device:{s.device}" if s.tier is Tier.DEVICE else s.tier.value for sid, s in self.items()}
