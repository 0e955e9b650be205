"""Weight sync on a node: a trainer's weights become one of its sampler snapshots' (a node
function, functions.Where.NODE: it reads the trainer's host copy, which write-through keeps current).

A snapshot is named per (trainer, name). Invariants: it is rewritten in place only when nobody
uses it (nor its replicas), it is not on DISK and it samples with the backend asked for; else a
new version `TRAINER@NAME.vN` is made and the old one retires once its queued calls drain. A
call that reaches the node after a sync retired and dropped the snapshot it names (it raced the
sync by milliseconds) runs on the one that replaced it, for the last SUPERSEDED_KEPT retired ones.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from plexrl.api.cluster import StateHandle
from plexrl.policy import Tier
from plexrl.runtime import precision
from plexrl.runtime.node_models import NodeModels
from plexrl.runtime.scheduler import GroupScheduler, Request
from plexrl.runtime.state import ModelState, skeleton_like
from plexrl.runtime.state_manager import StateManager
from plexrl.samplers.vllm_sampler import check_vllm_state

SUPERSEDED_KEPT = 1024  # retired snapshots a late call may still name (it races its sync by milliseconds)


@dataclass(frozen=True)
class Synced:
    """A weight sync's outcome: the snapshot now holding the trainer's weights under `name`."""

    snapshot: StateHandle
    name: str


class WeightSync:
    def __init__(self, models: NodeModels, state_manager: StateManager, scheduler: GroupScheduler,
                 lock: threading.Condition):
        self.models = models
        self.sm = state_manager
        self.scheduler = scheduler
        self.lock = lock
        self._samplers: dict[tuple[str, str], str] = {}  # (trainer, name) -> its current snapshot
        # retired snapshot -> its (trainer, name): a call racing the sync that retired it follows it
        self._superseded: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._versions: dict[tuple[str, str], int] = {}

    def sync(self, trainer: ModelState, name: str, sampler: str = "hf") -> Synced:
        """`trainer`'s weights become its sampler snapshot `name`'s: in place when nobody uses the
        snapshot (and it samples with `sampler`), else in a new version (the old one retires once
        its queued calls drain)."""
        check_vllm_state(sampler, trainer.lora)
        weights = trainer.segment(trainer.host, 0)
        key = (trainer.state_id, name)
        with self.lock:
            current = self._samplers.get(key)
            snapshot = self.sm.find(current) if current else None
            reusable = (snapshot is not None and not self.sm.in_use(current, self.scheduler.pending)
                        and snapshot.tier is not Tier.DISK and snapshot.sampler == sampler)
            if reusable:
                snapshot.busy = True
                snapshot.weights_version += 1  # a vLLM engine holding the old ones pushes these
                self.sm.host_copy_changed(snapshot)  # rewritten below
        if reusable:
            self.sm.materialize(snapshot, trainer.job,  # rounded to nearest into a bfloat16 snapshot
                                lambda: snapshot.segment(snapshot.host, 0).copy_(weights).nbytes)
            with self.lock:
                snapshot.busy = False
                self.lock.notify_all()
            return Synced(self.models.handle(snapshot), name)
        fresh = self._new_version(trainer, name, sampler, weights)
        if snapshot is not None:
            self._superseded[snapshot.state_id] = key
            while len(self._superseded) > SUPERSEDED_KEPT:
                self._superseded.popitem(last=False)
            self.scheduler.retire(snapshot.state_id, lambda sid=snapshot.state_id: self.models.remove(sid))
        return Synced(self.models.handle(fresh), name)

    def _new_version(self, trainer: ModelState, name: str, sampler: str, weights) -> ModelState:
        """A new snapshot of `trainer` holding `weights`, now the current one of `name`."""
        key = (trainer.state_id, name)
        version = self._versions[key] = self._versions.get(key, 0) + 1
        module = (skeleton_like(trainer.module) if trainer.lora is None
                  else self.models.lora_module(trainer.source, trainer.lora))  # a snapshot of an adapter is an adapter
        dtype, _ = precision.state_dtypes(self.models.precision(), False, trainer.lora)
        fresh = ModelState(f"{trainer.state_id}@{name}.v{version}", trainer.job, f"{trainer.name}@{name}",
                           module, False, trainer.source, lora=trainer.lora, sampler=sampler, dtype=dtype)
        self.sm.add(fresh, self.scheduler.pending, initial=weights, holding=frozenset({trainer.state_id}))
        self.models.fit_arenas(holding=frozenset({trainer.state_id}))  # a first vLLM snapshot keeps its engine's share
        self._samplers[key] = fresh.state_id
        return fresh

    def follow_superseded(self, request: Request) -> None:
        """A call that reaches the node after a sync retired and dropped its sampler snapshot
        (its client named the snapshot that was latest when the call was made, and the sync ran
        before the call arrived) runs on the snapshot that replaced it: a sampling client follows
        the latest sync (`api.client.SamplingClient`). A snapshot still here keeps its calls."""
        key = self._superseded.get(request.state_id)
        if key is not None and self.sm.find(request.state_id) is None and key in self._samplers:
            request.state_id = self._samplers[key]
