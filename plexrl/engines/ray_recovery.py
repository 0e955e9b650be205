"""Checkpoints and node loss, for the Ray engine's front (a mixin of RayCluster).

Checkpoints. Every successful `save_state` is remembered as its model's latest checkpoint (path,
time, the job's last reported step). With `checkpoint_every_steps=k`, the front also checkpoints
every trainable model of a job at each k-th step mark (`report_step`), with its optimizer, as
`auto-step-N` in the checkpoint directory, and removes the previous automatic one once the new one
is complete (checkpoint folders are renamed into place: complete or absent). The directory is
node-local by default; give a path every node sees (a network filesystem) to recover across nodes.

Node loss. When a node runtime actor dies (its Ray node is gone), the first call that notices
starts the recovery of its node group, once:
1. the group is retired from placement (nothing is placed there again) and its jobs leave it;
2. each job is admitted again (the Placer picks a surviving group); its models are added there —
   trainable ones restored from their latest checkpoint (weights, Adam moments and step), frozen
   ones from their base model — keeping their ids, so the job's clients work unchanged; every
   sampler name is synced again from the restored weights;
3. the calls that were in flight or sent to the lost group fail with the retriable WorkerFailed,
   once the job is restored, naming where it was restored from (`recovery_point(job)` too): the
   job resumes from that step. A model with no checkpoint restarts from its base model.
Everything is counted in `metrics()["recovery"]` (node_losses, restored_from_checkpoint,
restored_from_base, lost_work_s: the work since each job's checkpoint) and logged as events
(`node_lost`, `job_restored`).
"""

from __future__ import annotations

import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import ray

from plexrl import errors
from plexrl.engines import hosting
from plexrl.policy import ModelMemory
from plexrl.runtime.job_placer import provisional_profile

AUTO_PREFIX = "auto-step-"


@dataclass(frozen=True)
class Checkpoint:
    path: str
    with_optimizer: bool
    t: float  # front clock when it completed
    step: int | None  # the job's last reported step then (None: before its first step mark)


class NodeRecovery:
    def _init_recovery(self, checkpoint_dir: str | Path | None, checkpoint_every_steps: int) -> None:
        if checkpoint_every_steps < 0:
            raise errors.ConfigError(f"checkpoint_every_steps={checkpoint_every_steps}; expected 0 (off) or more")
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else self.workdir / "checkpoints"
        self.checkpoint_every_steps = checkpoint_every_steps
        self._checkpoints: dict[str, Checkpoint] = {}
        self._steps: dict[str, int] = {}
        self._started: dict[str, float] = {}
        self._lost: dict[int, threading.Event] = {}
        self._recovery_lock = threading.Lock()
        self._recovery_points: dict[str, dict] = {}
        self.recovery = {"node_losses": 0, "restored_from_checkpoint": 0, "restored_from_base": 0, "lost_work_s": 0.0}

    def live_nodes(self) -> list:
        return [node for group, node in enumerate(self.nodes) if group not in self._lost]

    def recovery_point(self, job: str) -> dict | None:
        """Where `job` was restored after a node loss: group, step, checkpoints (None if never)."""
        return self._recovery_points.get(job)

    # -- checkpoints ---------------------------------------------------------------------------------
    def _saved(self, state, payload: dict) -> None:
        self._checkpoints[state.state_id] = Checkpoint(payload["path"], payload["with_optimizer"], self.telemetry.now(),
                                                       self._steps.get(state.job))

    def _step_mark(self, job: str, step: int) -> None:
        self._steps[job] = step
        every = self.checkpoint_every_steps
        if not every or (step + 1) % every:
            return
        trainers = [h for h in list(self._handles.values()) if h.job == job and h.trainable]
        before = {h.state_id: self._checkpoints.get(h.state_id) for h in trainers}
        saves = [self.submit(h, "save_state", {"path": str(self.checkpoint_path(h, f"{AUTO_PREFIX}{step}")),
                                                 "with_optimizer": True}) for h in trainers]
        for save in saves:
            save.result()
        for state_id, old in before.items():
            if old is not None and Path(old.path).name.startswith(AUTO_PREFIX) and old.path != self._checkpoints[state_id].path:
                shutil.rmtree(old.path, ignore_errors=True)

    # -- node loss -------------------------------------------------------------------------------------
    @staticmethod
    def _is_node_loss(exc: BaseException) -> bool:
        """A node runtime actor died (errors of its calls arrive wrapped, never as ActorDiedError)."""
        return isinstance(exc, ray.exceptions.ActorDiedError)

    def _fail_after_recovery(self, group: int, future, state, fn: str) -> None:
        try:
            self._recover(group)
        except Exception as exc:  # the caller must hear of it, whatever happened
            future.set_exception(errors.WorkerFailed(
                f"node group {group} was lost while {fn} on {state.state_id!r} was queued or running, and restoring "
                f"job {state.job!r} elsewhere failed: {type(exc).__name__}: {exc}"))
            raise
        point = self._recovery_points.get(state.job)
        where = "nowhere (no node group had room)" if point is None else (
            f"on node group {point['group']} from " + (f"its checkpoint of step {point['step']}" if point["checkpoints"]
                                                        else "its base model (it had no checkpoint)"))
        future.set_exception(errors.WorkerFailed(
            f"node group {group} was lost while {fn} on {state.state_id!r} was queued or running; job {state.job!r} "
            f"was restored {where}; calls since then did not take effect: resume from there and submit again"))

    def _recover(self, group: int) -> None:
        """Re-place and restore every job of a lost node group (once; later callers wait for it)."""
        with self._recovery_lock:
            done = self._lost.get(group)
            first = done is None
            if first:
                done = self._lost[group] = threading.Event()
        if not first:
            done.wait()
            return
        try:
            lost_at = self.telemetry.now()
            jobs = self.router.jobs_on(group)
            self.placer.retire_group(group, jobs, lost_at)
            self.recovery["node_losses"] += 1
            self.telemetry.events.emit(lost_at, "node_lost", group=group, node_id=self.node_ids[group], jobs=jobs)
            for job in jobs:
                self._restore_job(job, lost_at)
        finally:
            done.set()

    def _restore_job(self, job: str, lost_at: float) -> None:
        handles = [h for h in list(self._handles.values()) if h.job == job]
        models = [h for h in handles if "@" not in h.name]  # sampler snapshots are synced again, not restored
        synced = {h.state_id: self.router.synced_names(h.state_id) for h in models if h.trainable}
        for h in handles:  # models stay routed to the lost group until rebound: their calls wait (submit)
            if h not in models:
                self.router.unbind(h.state_id)
            with self._lock:
                self._handles.pop(h.state_id, None)
                self._seq.pop(h.state_id, None)  # the new node numbers this model's calls from 0
        self.router.forget(job)
        memory = [ModelMemory(h.name, h.device_bytes, h.host_bytes) for h in models]
        group = self._admit(provisional_profile(job, memory, self.placer.slot_s), 0.10, True, None)
        restored = {}
        for h in models:
            hosting.get(self.nodes[group].add_model.remote(job, h.name, h.source, h.trainable))
            self._bind(h, group)
            checkpoint = self._checkpoints.get(h.state_id)
            if checkpoint is None:
                self.recovery["restored_from_base"] += 1
                continue
            self.submit(h, "load_state", {"path": checkpoint.path, "with_optimizer": checkpoint.with_optimizer}).result()
            self.recovery["restored_from_checkpoint"] += 1
            restored[h.name] = checkpoint
        for h in models:
            for name in synced.get(h.state_id, ()):
                self.submit(h, "sync_weights", {"name": name}).result()
        trainables = [h for h in models if h.trainable]
        since = min((restored[h.name].t if h.name in restored else self._started.get(job, 0.0)) for h in trainables) \
            if trainables else lost_at
        self.recovery["lost_work_s"] += lost_at - since
        steps = [c.step for c in restored.values() if c.step is not None]
        self._recovery_points[job] = {"group": group, "step": min(steps) if steps else None,
                                      "checkpoints": {name: c.path for name, c in restored.items()}}
        self.telemetry.events.emit(self.telemetry.now(), "job_restored", job=job, lost_work_s=lost_at - since,
                                   **self._recovery_points[job])
