"""A simulated worker: one GPU and the residency of the state shards placed on it.

The worker holds, per job placed on it, one shard of each of the job's model states. It keeps
plain mutable records (fast to update on the hot path) and builds the policy's frozen
`ResidencyView` only when a dispatch needs a state that is not resident, then applies the
`LoadPlan` that `plexrl.policy.plan_load` returns, transition by transition.

Invariants (tested): the bytes resident in the arena never exceed its capacity; a request
executes only after its state is DEVICE-resident on every GPU of its gang; host bytes never
exceed the host share (the GPU's share of its node's host memory) — beyond it, states spill
to disk. `used` is always the sum of the DEVICE-resident bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from plexrl.policy import BandwidthEstimator, NoFit, ResidencyView, StateInfo, Tier, plan_load
from plexrl.policy.types import TransitionKind

DEVICE, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK


class Resident:
    """Where one state shard lives on this worker. `loaded_nbytes` of its `nbytes` are copied in
    by a load (a sampler's KV reserve is allocated, not copied); a `read_only` state's host copy
    is always current, so an offload copies nothing out (as the runtime lets a clean copy go)."""

    __slots__ = ("state_id", "job", "nbytes", "host_nbytes", "loaded_nbytes", "read_only", "tier", "offset",
                 "last_used")

    def __init__(self, state_id: str, job: str, nbytes: int, host_nbytes: int | None = None,
                 loaded_nbytes: int | None = None, read_only: bool = False):
        self.state_id, self.job, self.nbytes = state_id, job, nbytes
        self.host_nbytes = nbytes if host_nbytes is None else host_nbytes  # its own host buffer
        self.loaded_nbytes = nbytes if loaded_nbytes is None else loaded_nbytes
        self.read_only = read_only
        self.tier, self.offset, self.last_used = HOST, None, 0.0


class Move(NamedTuple):  # a tuple: built on every transition (the hot path)
    kind: TransitionKind
    state_id: str
    nbytes: int
    seconds: float


PLANS_KEPT = 512  # plans remembered per GPU; forgotten all at once when full (jobs come and go)

# `TransitionKind.value` goes through the enum's descriptor on every access; the hot path looks it up
KIND_NAME = {kind: kind.value for kind in TransitionKind}


@dataclass(slots=True, eq=False)
class SimRequest:
    """One function call of one job, pinned to its gang: the GPUs holding the shards it runs on
    (affinity), all occupied together from dispatch to end."""

    job: "SimJob"  # the controller that issued it (`plexrl.sim.service.SimJob`)
    state_id: str
    fn: str
    exec_s: float
    arrival: float
    gang: tuple["SimWorker", ...]


@dataclass(eq=False, slots=True)  # slots: its fields are read and written on every call
class SimWorker:
    wid: int
    arena_bytes: int
    host_bytes: int
    link_bytes_per_s: float  # host<->device of this GPU
    disk_bytes_per_s: float  # this GPU's share of its node's disk
    states: dict[str, Resident] = field(default_factory=dict)
    busy: bool = False
    expected_end: float = 0.0  # when the running call is expected to end (estimates, for backfill)
    used: int = 0  # DEVICE-resident bytes
    group: object = None  # the `Group` whose scheduler dispatches onto this GPU
    bandwidth: BandwidthEstimator = field(init=False, repr=False)
    plans: dict = field(default_factory=dict, repr=False)  # plan key -> plan_load's plan (see `plan_key`)

    def __post_init__(self) -> None:
        self.bandwidth = BandwidthEstimator(prior_bytes_per_s=self.link_bytes_per_s)

    # --- states -------------------------------------------------------------------------
    def add_state(self, state_id: str, job: str, nbytes: int, host_nbytes: int | None = None,
                  loaded_nbytes: int | None = None, read_only: bool = False) -> None:
        """`host_nbytes`: its own host buffer (default `nbytes`; 0 for a state whose host copy
        is another state's, as a sampler's weights are its trainer's); `loaded_nbytes` and
        `read_only`: what its loads and offloads copy (`Resident`)."""
        if nbytes > self.arena_bytes:
            raise ValueError(
                f"state {state_id} needs {nbytes / 1e9:.1f} GB per GPU but a GPU's arena holds "
                f"{self.arena_bytes / 1e9:.1f} GB; raise tp or dp"
            )
        self.states[state_id] = Resident(state_id, job, nbytes, host_nbytes, loaded_nbytes, read_only)

    def remove_job(self, job: str) -> None:
        for sid in [s for s, r in self.states.items() if r.job == job]:
            if self.states[sid].tier is DEVICE:
                self.used -= self.states[sid].nbytes
            del self.states[sid]

    def host_used(self) -> int:
        return sum(r.host_nbytes for r in self.states.values() if r.tier is not DISK)

    def arena_used(self) -> int:
        return sum(r.nbytes for r in self.states.values() if r.tier is DEVICE)

    def is_resident(self, state_id: str) -> bool:
        return self.states[state_id].tier is DEVICE

    # --- estimates for the priority -------------------------------------------------------
    def load_estimate_s(self, state_id: str) -> float:
        return self.bandwidth.seconds("load", self.states[state_id].loaded_nbytes)

    def free_bytes(self) -> int:
        """Arena bytes a load can use without offloading anything (T_offload is for the rest)."""
        return self.arena_bytes - self.used

    # --- making a state resident ------------------------------------------------------------
    def view(self, now: float, pending: set[str] | None = None) -> ResidencyView:
        pending = self.pending() if pending is None else pending
        infos = {
            sid: StateInfo(
                sid, r.job, r.nbytes, r.host_nbytes, r.tier,
                self.wid if r.tier is DEVICE else None, r.offset,
                False, 1 if sid in pending else 0, r.last_used,
            )
            for sid, r in self.states.items()
        }
        return ResidencyView(infos, {self.wid: self.arena_bytes}, self.host_bytes)

    def plan_key(self, state_id: str, pending: set[str]) -> tuple:
        """Everything `plan_load` reads from this GPU's `view`, with last-use times replaced by
        their dense ranks: the planner only compares last-use times (tested), so equal keys get
        equal plans. The arena and host capacities are the GPU's own and never change."""
        states = self.states.values()
        rank = {t: i for i, t in enumerate(sorted({r.last_used for r in states}))}
        return state_id, tuple([(r.state_id, r.tier, r.offset, r.nbytes, r.state_id in pending, rank[r.last_used])
                                for r in states])

    def pending(self) -> set[str]:
        """States with queued work on this GPU: the planner keeps them resident if it can."""
        return self.group.pending_states(self) if self.group is not None else set()

    def make_resident(self, state_id: str, now: float) -> list[Move]:
        """Plan with the policy, apply the plan; returns the moves made, in order. A GPU cycles
        through the same few residencies, so plans are remembered by `plan_key`."""
        pending = self.pending()
        key = self.plan_key(state_id, pending)
        plan = self.plans.get(key)
        if plan is None:
            plan = plan_load(self.view(now, pending), state_id, self.wid)
            if isinstance(plan, NoFit):
                raise RuntimeError(f"worker {self.wid}: {plan.reason}")
            if len(self.plans) >= PLANS_KEPT:
                self.plans.clear()
            self.plans[key] = plan
        moves = [self._apply(t.kind, t.state_id, t.offset) for t in plan.transitions]
        if self.used > self.arena_bytes:
            raise RuntimeError(f"worker {self.wid}: arena over budget after loading {state_id}")
        return moves

    def _apply(self, kind: TransitionKind, state_id: str, offset: int | None) -> Move:
        r = self.states[state_id]
        if kind is TransitionKind.LOAD:
            r.tier, r.offset = DEVICE, offset
            self.used += r.nbytes
            moved = r.loaded_nbytes
            seconds = moved / self.link_bytes_per_s
        elif kind is TransitionKind.OFFLOAD:
            r.tier, r.offset = HOST, None
            self.used -= r.nbytes
            moved = 0 if r.read_only else r.nbytes
            seconds = moved / self.link_bytes_per_s
        elif kind is TransitionKind.SPILL:
            r.tier = DISK
            moved = r.host_nbytes
            seconds = moved / self.disk_bytes_per_s
        elif kind is TransitionKind.RESTORE:
            r.tier = HOST
            moved = r.host_nbytes
            seconds = moved / self.disk_bytes_per_s
        else:
            raise ValueError(f"transition kind {kind} is not applied by the simulator")
        if moved:
            self.bandwidth.observe(KIND_NAME[kind], moved, seconds)
        return Move(kind, state_id, moved, seconds)


def mark_used(gang: tuple[SimWorker, ...], sid: str, now: float) -> bool:
    """Record that state `sid` is used now on every GPU of the gang; whether it is resident on
    all of them."""
    resident = True
    for w in gang:
        state = w.states[sid]
        state.last_used = now
        if state.tier is not DEVICE:
            resident = False
    return resident
