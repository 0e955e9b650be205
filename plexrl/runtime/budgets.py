"""A node's budgets and what they keep beside its states (state_manager.py's docstring: the device budget).

A device's budget (device_memory_bytes) is everything PlexRL may use on it; states get what is
left once the activation reserve of the largest model the node hosts, the vLLM engines' shares and
the shared frozen LoRA bases are set aside (`BesideStates`), the same on every device of the node.
The host budget loses the shared bases too. The node books each base model's needs here
(`set_needs`, measured by its workers when the model is first added).

Invariants: `arena_bytes` is what every arena of the node is sized to (the node resizes arenas when
it changes); a state is admitted (`check_fits`) only when it fits alone beside what it adds and
every state already here still fits next to that. Runs under the node's lock (no lock of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plexrl.api import errors
from plexrl.runtime.arena import DeviceArena
from plexrl.runtime.state import FLOAT_BYTES, ModelState
from plexrl.runtime.state_table import StateTable


@dataclass(frozen=True)
class BesideStates:
    """What a device's budget keeps beside its states (bytes, the same on every device of a node)."""

    reserve_bytes: int = 0  # activations of the largest model hosted
    reserve_of: str | None = None  # that model's folder
    engine_bytes: int = 0  # vLLM engines (weights, KV cache, graphs)
    shared_bytes: int = 0  # shared frozen LoRA bases

    @property
    def total(self) -> int:
        return self.reserve_bytes + self.engine_bytes + self.shared_bytes

    def parts(self) -> str:
        """' + R activation reserve of model folder X + E for vLLM engines + S of shared LoRA bases'."""
        of = f" of model folder {self.reserve_of!r}" if self.reserve_of else " (activation_reserve_bytes)"
        out = f" + {self.reserve_bytes:,} activation reserve{of}" if self.reserve_bytes or self.reserve_of else ""
        if self.engine_bytes:
            out += f" + {self.engine_bytes:,} for vLLM engines"
        if self.shared_bytes:
            out += f" + {self.shared_bytes:,} of shared frozen LoRA base weights"
        return out


class NodeBudgets:
    def __init__(self, states: StateTable, arenas: dict[int, DeviceArena], host_capacity: int):
        """`states`: the StateManager's table (read only); `arenas`: the devices' budgets."""
        self._states = states
        self._arenas = arenas
        self.host_capacity = host_capacity
        self._reserves: dict[str, int] = {}  # base model folder -> its activation reserve (the node measures it)
        self._engine_shares: dict[str, int] = {}  # base model folder -> its vLLM engine's share of a device

    def set_needs(self, source: str, reserve: int, engine_share: int) -> bool:
        """A base model's activation reserve and vLLM engine share; whether its reserve is new."""
        known = self._reserves.get(source)
        self._reserves[source] = reserve
        self._engine_shares[source] = engine_share
        return known is None

    def reserves(self) -> dict[str, int]:
        """Each base model folder's activation reserve (a copy)."""
        return dict(self._reserves)

    def needs_of(self, state: ModelState) -> tuple[int, int]:
        """(its model's activation reserve, its vLLM engine's share: 0 unless it samples on vLLM)."""
        return (self._reserves.get(state.source, 0),
                self._engine_shares.get(state.source, 0) if state.sampler == "vllm" else 0)

    def beside(self, adding: ModelState | None = None) -> BesideStates:
        """What every device keeps beside the node's states (and `adding`'s): see the module docstring."""
        states = [*self._states.values(), *([adding] if adding is not None else [])]
        sources = {s.source for s in states}
        largest = max(sorted(sources), key=lambda src: self._reserves.get(src, 0), default=None)
        engines = sum(self._engine_shares.get(src, 0) for src in {s.source for s in states if s.sampler == "vllm"})
        return BesideStates(self._reserves.get(largest, 0), largest, engines, self.shared_bytes(adding))

    def budget(self) -> int:
        return min(a.budget_bytes for a in self._arenas.values())

    def arena_bytes(self, adding: ModelState | None = None) -> int:
        """The bytes states may use on each device: the budget less what is kept beside them."""
        return self.budget() - self.beside(adding).total

    def shared_bytes(self, adding: ModelState | None = None) -> int:
        """Bytes of the shared LoRA bases the node's states stand on (and `adding`'s), each counted once."""
        states = [*self._states.values(), *([adding] if adding is not None else [])]
        return sum({s.source: s.shared_bytes for s in states if s.lora is not None}.values())

    def check_fits(self, state: ModelState) -> None:
        """StateTooLarge unless the state fits this node's budgets when nothing but what is kept
        beside the states (its own reserve, engine and base included) is there, and unless every
        state already here still fits next to what it adds."""
        budget, beside = self.budget(), self.beside(state)
        check_budgets(state.name, state.job, state.trainable, state.device_bytes, state.host_bytes, budget,
                      self.host_capacity, beside.shared_bytes, state.dtype, beside)
        largest = max(self._states.values(), key=lambda s: s.device_bytes, default=None)
        if largest is not None and beside.total > self.beside().total and largest.device_bytes + beside.total > budget:
            raise errors.StateTooLarge(
                f"cannot add model {state.name!r} of job {state.job!r}: model {largest.name!r} of job {largest.job!r} "
                f"already here needs {largest.device_bytes:,} device bytes{beside.parts()} = "
                f"{largest.device_bytes + beside.total:,} > the device budget of {budget:,} bytes once it is added; "
                f"expected device_memory_bytes >= {largest.device_bytes + beside.total:,}")

    def free_bytes(self, device: int) -> int:
        """What `device`'s arena has free now."""
        return self._arenas[device].capacity_bytes - self._states.resident_bytes(device)

    def stale_arenas(self) -> list[int]:
        """The devices whose arena is not at the size `arena_bytes` gives it now."""
        size = self.arena_bytes()
        return [d for d, arena in self._arenas.items() if arena.capacity_bytes != size - size % FLOAT_BYTES]

    def split(self, device: int) -> dict:
        """How a device's budget is split: what is kept beside the states, and what states may use."""
        beside, arena = self.beside(), self._arenas[device]
        return {"device_memory_bytes": arena.budget_bytes, "activation_reserve_bytes": beside.reserve_bytes,
                "activation_reserve_of": beside.reserve_of, "engine_bytes": beside.engine_bytes,
                "shared_bytes": beside.shared_bytes, "state_bytes": min(arena.capacity_bytes, self.arena_bytes())}


def check_budgets(name: str, job: str, trainable: bool, device_bytes: int, host_bytes: int, device_budget: int,
                  host_budget: int, shared_bytes: int = 0, dtype: torch.dtype = torch.float32,
                  beside: BesideStates | None = None) -> None:
    """StateTooLarge unless a state of these sizes (its flat memory in `dtype`) fits the budgets
    when nothing else is there but what a device keeps `beside` its states (default: only
    `shared_bytes` of shared LoRA bases) and, on the host, `shared_bytes` (counted once on each budget)."""
    what = ("weights, gradients and Adam moments" if trainable else "weights") + f", {str(dtype).removeprefix('torch.')}"
    beside = beside or BesideStates(shared_bytes=shared_bytes)
    if device_bytes + beside.total > device_budget:
        need = device_bytes + beside.total
        raise errors.StateTooLarge(
            f"model {name!r} of job {job!r} needs {device_bytes:,} device bytes ({what}){beside.parts()} = {need:,} "
            f"> the device budget of {device_budget:,} bytes; expected device_memory_bytes >= {need:,}"
        )
    if host_bytes + shared_bytes > host_budget:
        raise errors.StateTooLarge(
            f"model {name!r} of job {job!r} needs {host_bytes + shared_bytes:,} host bytes but the "
            f"node's host budget is {host_budget:,}; expected host_memory_bytes >= {host_bytes + shared_bytes:,}"
        )
