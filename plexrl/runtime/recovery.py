"""Checkpoints and node loss, for every front (a mixin of runtime/front.py's Front; the shared
records live in the control plane, control.py, so any front can recover any job).

Checkpoints. Every successful `save_state` is remembered as its model's latest checkpoint (path,
time, the job's last reported step). With `checkpoint_every_steps=k`, the front also checkpoints
every trainable model of a job at each k-th step mark (`report_step`), with its optimizer, as
`auto-step-N` in the checkpoint directory, and removes the previous automatic one once the new one
is complete (checkpoint folders are renamed into place: complete or absent). The directory is
node-local by default; give a path every node sees (a network filesystem) to recover across nodes.

Node loss (where an engine can lose a node: on Ray, a node runtime actor dies with its Ray node;
the local and process engines host every node in the front's process). The first front whose call
notices it recovers its node group, once (the control plane arbitrates):
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
import time

from plexrl.api import errors
from plexrl.runtime import remote
from plexrl.runtime.control import Checkpoint, Recovery, RestoreInputs
from plexrl.runtime.job_placer import provisional_profile
from plexrl.runtime.payloads import CheckpointPayload, SyncPayload

AUTO_PREFIX = "auto-step-"
RECOVERY_POLL_S = 0.05


class NodeRecovery:
    def recovery_point(self, job: str) -> dict | None:
        """Where `job` was restored after a node loss: group, step, checkpoints (None if never)."""
        return self.plane.recovery_point(job)

    # -- checkpoints ---------------------------------------------------------------------------------
    def _saved(self, state, payload: CheckpointPayload) -> None:
        self.plane.saved(state.state_id, state.job, payload.path, payload.with_optimizer)

    def _step_mark(self, job: str, step: int) -> None:
        """Every `checkpoint_every_steps` step marks: checkpoint each trainable model of `job` as
        `auto-step-N`; once it is complete, the model's earlier automatic checkpoints go."""
        every = self.checkpoint_every_steps
        if not every or (step + 1) % every:
            return
        trainers = [h for h in list(self.routes.handles.values()) if h.job == job and h.trainable]
        paths = {h.state_id: self.checkpoint_path(h, f"{AUTO_PREFIX}{step}") for h in trainers}
        saves = [self.submit(h, "save_state", CheckpointPayload(str(paths[h.state_id]), True)) for h in trainers]
        for save in saves:
            save.result()
        for path in paths.values():
            for old in path.parent.glob(f"{AUTO_PREFIX}*"):
                if old != path:
                    shutil.rmtree(old, ignore_errors=True)

    # -- node loss -------------------------------------------------------------------------------------
    def _fail_after_recovery(self, group: int, future, state, fn: str) -> None:
        try:
            self._recover(group)
        except Exception as exc:  # the caller must hear of it, whatever happened
            future.set_exception(errors.WorkerFailed(
                f"node group {group} was lost while {fn} on {state.state_id!r} was queued or running, and restoring "
                f"job {state.job!r} elsewhere failed: {type(exc).__name__}: {exc}"))
            raise
        point = self.recovery_point(state.job)
        where = "nowhere (no node group had room)" if point is None else (
            f"on node group {point['group']} from " + (f"its checkpoint of step {point['step']}" if point["checkpoints"]
                                                        else "its base model (it had no checkpoint)"))
        future.set_exception(errors.WorkerFailed(
            f"node group {group} was lost while {fn} on {state.state_id!r} was queued or running; job {state.job!r} "
            f"was restored {where}; calls since then did not take effect: resume from there and submit again"))

    def _recover(self, group: int) -> None:
        """Re-place and restore every job of a lost node group, or wait for the front doing it."""
        self.routes.lost_seen.add(group)
        jobs = self.plane.begin_recovery(group)
        if jobs is None:
            self._await_recoveries()
        else:
            try:
                lost_at = self.plane.now()
                for job in jobs:
                    self._restore_job(job, lost_at)
            finally:
                self.plane.end_recovery(group)
        self.routes.refresh()

    def _await_recoveries(self) -> None:
        while Recovery.RUNNING in (lost := self.plane.lost_groups()).values():
            time.sleep(RECOVERY_POLL_S)
        self.routes.lost_seen.update(lost)

    def _restore_job(self, job: str, lost_at: float) -> None:
        inputs = self.plane.restore_inputs(job)
        models = [h for h in inputs.handles if not h.is_snapshot]
        memory = self.models.memory(models)
        group = self._admit(provisional_profile(job, memory, self.slot_s), 0.10, True, None)
        restored = self._reinstate(job, group, inputs)
        from_base = len(models) - len(restored)
        trainables = [h for h in models if h.trainable]
        since = min((restored[h.name].t if h.name in restored else inputs.started) for h in trainables) \
            if trainables else lost_at
        steps = [c.step for c in restored.values() if c.step is not None]
        point = {"group": group, "step": min(steps) if steps else None, "lost_work_s": lost_at - since,
                 "checkpoints": {name: c.path for name, c in restored.items()}}
        self.plane.restored(job, point, {"restored_from_checkpoint": len(restored), "restored_from_base": from_base,
                                         "lost_work_s": lost_at - since})

    def _reinstate(self, job: str, group: int, inputs: RestoreInputs) -> dict[str, Checkpoint]:
        """Add `job`'s models on `group`, keeping their ids (its clients work unchanged): trainable
        ones loaded from their latest checkpoint, the others from their base model; then sync every
        sampler name again (snapshots are not moved). Returns the checkpoints used, by model name."""
        models = [h for h in inputs.handles if not h.is_snapshot]
        for h in inputs.handles:
            if h not in models:
                self.plane.unbind(h.state_id)
        restored = {}
        for h in models:
            remote.get(self.nodes[group].add_model.remote(job, h.name, h.source, h.trainable, h.lora,
                                                          h.sampler))
            self.routes.bind(h, group)
            checkpoint = inputs.checkpoints.get(h.state_id)
            if checkpoint is not None and h.trainable:
                self.submit(h, "load_state", CheckpointPayload(checkpoint.path, checkpoint.with_optimizer)).result()
                restored[h.name] = checkpoint
        samplers = {h.name: h.sampler for h in inputs.handles if h.is_snapshot}  # "trainer@name" -> sampler
        for h in models:
            for name in inputs.synced.get(h.state_id, ()):
                sampler = samplers.get(f"{h.name}@{name}", "hf")
                self.submit(h, "sync_weights", SyncPayload(name, sampler)).result()
        return restored
