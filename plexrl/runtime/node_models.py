"""The models of one node as its callers see them: making a model state (its module, its dtypes,
what its base model needs beside it on every device), its handle, removing it.

LoRA states (runtime/lora.py): the node keeps one frozen base module per source (`_bases`), on
which every LoRA state of that source and its sampler snapshots build their modules; their host
copies hold only their adapters. The StateManager counts each base once (budgets.py).

The device budget (budgets.py) keeps each base model's activation reserve, which the workers
measure when its first model is added here (or `activation_reserve_bytes` when set by hand), and
its vLLM engine's share beside the states. When what is kept beside them grows (a new model, a
first vLLM snapshot), `fit_arenas` holds the devices between calls, drops their device copies and
has the workers let their arenas go, to be allocated at the smaller size. Arenas grow back only
when a model is next added (removing one never waits for the devices).

Invariants: every arena of the node is at `NodeBudgets.arena_bytes` once `add` returns (unless the
cluster is closing); a base module is kept exactly while a LoRA state of its source is here.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

from plexrl.api import errors
from plexrl.api.cluster import StateHandle
from plexrl.api.types import LoraConfig
from plexrl.runtime import activation, lora, precision, remote
from plexrl.runtime.scheduler import GroupScheduler
from plexrl.runtime.state import ModelState, load_module
from plexrl.runtime.state_manager import StateManager
from plexrl.runtime.telemetry import Telemetry
from plexrl.runtime.worker_health import RESTART_POLL_S
from plexrl.samplers.vllm_sampler import check_vllm_state

if TYPE_CHECKING:
    from plexrl.runtime.node import NodeConfig


class NodeModels:
    def __init__(self, config: NodeConfig, state_manager: StateManager, scheduler: GroupScheduler,
                 lock: threading.Condition, telemetry: Telemetry, dispatching: Callable[[], bool]):
        """`config.precision`: "fp32" or "bf16", or "auto" when the front could not tell what the
        workers run on (Ray): the first state's making asks them (runtime/precision.py).
        `config.activation_reserve_bytes`: every model's reserve (None: the workers measure it on a
        batch of `activation_probe_tokens` tokens, runtime/activation.py). `dispatching()`: whether
        every dispatcher of the node still runs (not once the cluster is closing)."""
        self.node = config.node
        self.workers = config.workers
        self.sm = state_manager
        self.scheduler = scheduler
        self.lock = lock
        self.telemetry = telemetry
        self._precision = config.precision
        self._reserve_by_hand, self._probe_tokens = config.activation_reserve_bytes, config.activation_probe_tokens
        self._dispatching = dispatching
        self._bases: dict[str, object] = {}  # source -> the frozen base module its LoRA states share
        self._bases_lock = threading.Lock()

    def add(self, job: str, name: str, source: str, trainable: bool,
            lora_config: LoraConfig | None = None, sampler: str = "hf") -> StateHandle:
        check_vllm_state(sampler, lora_config)
        measure = self._reserve_by_hand is None
        autocast = activation.trainer_autocast(self.precision())  # the reserve is a trainer's
        prepared = [worker.prepare.remote(source, self._probe_tokens, measure, autocast)  # meanwhile, there
                    for worker in self.workers.values()]
        module = load_module(source) if lora_config is None else self.lora_module(source, lora_config)
        dtype, autocast = precision.state_dtypes(self.precision(), trainable, lora_config)
        state = ModelState(f"{job}/{name}", job, name, module, trainable, source, lora=lora_config, sampler=sampler,
                           dtype=dtype, autocast=autocast)
        self._book_needs(source, prepared)
        self.sm.add(state, self.scheduler.pending)
        self.fit_arenas()
        return self.handle(state)

    def _book_needs(self, source: str, prepared: list) -> None:
        """What a model of `source` needs beside its state, from the workers' `prepare` replies
        (every worker of the node can run it from its first call on): the largest reserve any
        device measured, or the one set by hand, and its vLLM engine's share."""
        needs = []
        for ref in prepared:
            try:
                needs.append(remote.get(ref))
            except Exception as exc:  # a worker that died meanwhile loads the template on first use
                if not remote.is_gone(exc):
                    raise
        if not needs:
            raise errors.WorkerFailed(f"no worker of node {self.node} answered while model folder {source!r} was "
                                      "prepared; the model was not added and may be added again")
        reserve = self._reserve_by_hand if self._reserve_by_hand is not None else max(r for r, _ in needs)
        with self.lock:
            first = self.sm.budgets.set_needs(source, reserve, max(e for _, e in needs))
        if first:
            self.telemetry.events.emit(self.telemetry.now(), "activation_reserve", node=self.node, source=source,
                                       bytes=reserve, measured=self._reserve_by_hand is None,
                                       probe_tokens=self._probe_tokens)

    def fit_arenas(self, holding: frozenset[str] = frozenset()) -> None:
        """Give the node's arenas the size its states leave them (NodeBudgets.arena_bytes) where
        that is smaller, or larger: the devices concerned get no new call, and once each waits
        between calls with none of its resident states in use (but those the caller `holding`s,
        whose node function uses only the host copy), their device copies are forgotten and the
        workers let their arenas go. Returns at once when the cluster is closing."""
        with self.lock:
            stale = self.sm.budgets.stale_arenas()
            if not stale:
                return
            self.scheduler.hold(stale)
            try:
                while not self._quiet(stale, holding):
                    if not self._dispatching():
                        return
                    self.lock.wait(RESTART_POLL_S)
                size = self.sm.budgets.arena_bytes()
                for state in self.sm.states.resident_on(stale):
                    self.sm.forget_device_copy(state)
                for device in stale:
                    self._resize(device, size)
            finally:
                self.scheduler.hold(stale, held=False)

    def _quiet(self, devices: list[int], holding: frozenset[str]) -> bool:
        return all(self.scheduler.between_calls(d) for d in devices) and not any(
            s.busy and s.state_id not in holding for s in self.sm.states.resident_on(devices))

    def _resize(self, device: int, size: int) -> None:
        """Waited for, under the node's lock: no later call can reach the worker before it."""
        try:
            remote.get(self.workers[device].resize.remote(size))
        except Exception as exc:  # a worker restarting: its new arena is sized when it is back
            if not remote.is_gone(exc):
                raise
        self.sm.arenas[device].resize(size)

    def handle(self, state: ModelState) -> StateHandle:
        reserve, engine = self.sm.budgets.needs_of(state)
        return StateHandle(state.state_id, state.job, state.name, state.source, state.trainable, state.device_bytes,
                           state.host_bytes, state.lora, state.sampler, reserve, engine)

    def lora_module(self, source: str, lora_config: LoraConfig):
        """A LoRA module over this node's one frozen base of `source` (loaded on first use)."""
        with self._bases_lock:
            if source not in self._bases:
                self._bases[source] = lora.frozen(load_module(source))
        return lora.lora_module(self._bases[source], lora_config)

    def precision(self) -> str:
        """The node's resolved precision; "auto" (Ray) is resolved from what its first worker
        that answers runs on (every worker of a node is on its machine)."""
        if self._precision == "auto":
            for worker in self.workers.values():
                try:
                    self._precision = precision.resolve("auto", remote.get(worker.runs_on.remote()))
                    break
                except Exception as exc:  # a worker restarting: ask the next one
                    if not remote.is_gone(exc):
                        raise
            else:
                raise errors.WorkerFailed(f"no worker of node {self.node} answered what device it runs on; "
                                          "the model was not added and may be added again")
        return self._precision

    def remove_job(self, job: str, states: list[str] | None = None) -> None:
        """Free every state of `job` (only `states`, when given) once its queued calls are done."""
        for sid in [sid for sid in self.sm.states.models_of(job) if states is None or sid in states]:
            with self.lock:
                while self.sm.in_use(sid, self.scheduler.pending):
                    self.lock.wait(0.01)
                self.remove(sid)
        if not self.sm.states.hosts_job(job):
            self.scheduler.forget_job(job)  # its last state here is gone

    def remove(self, state_id: str) -> None:
        source = self.sm.state(state_id).source
        gone = self.sm.remove(state_id)
        with self._bases_lock:  # the last LoRA state of a base lets the node's copy go
            if not self.sm.states.stands_on_base(source):
                self._bases.pop(source, None)
        for worker in self.workers.values():
            for sid in gone:
                worker.forget.remote(sid)
