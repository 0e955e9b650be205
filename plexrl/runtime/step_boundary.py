"""What a front does at a job's step boundary, for every engine (a mixin of runtime/front.py's
Front, like recovery.py's NodeRecovery; the shared records live in the control plane).

A step mark (`report_step`) is logged by the control plane (a job's measured profile is read
from these events), restarts the count of the job's waits against its slack on its group's
scheduler, checkpoints the job's trainable models every `checkpoint_every_steps` steps
(recovery.py), and gives the placer its look at the job's measured profile: when the placer
moves the job, it migrates here, between its steps, through the checkpoint directory
(`migrate`), and resumes on its new phase.

Invariants: a job migrates only between its steps (its trainable models saved after their last
call); its models keep their ids, so its clients work unchanged; the step it starts on its new
group is marked there.
"""

from __future__ import annotations

import time

from plexrl.runtime import remote
from plexrl.runtime.payloads import CheckpointPayload


class StepBoundary:
    def report_step(self, job: str, step: int, **fields) -> None:
        """A job's step boundary: logged, a checkpoint every `checkpoint_every_steps` steps
        (recovery.py), and the placer's look at its measured profile (`_replace`)."""
        profile_due, since, group, slack = self.plane.step(job, step, fields)
        if group is not None and slack is not None:
            self._mark_on_node(group, job, slack)
        self._step_mark(job, step)
        self._replace(job, profile_due, since, group, slack)

    def _mark_on_node(self, group: int, job: str, slack: float) -> None:
        """The job's group scheduler starts counting its next step's waits against `slack`; a
        node found gone is left to recovery (its next call finds it)."""
        try:
            remote.get(self.nodes[group].step_mark.remote(job, slack))
        except Exception as exc:
            if not remote.is_gone(exc):
                raise

    def _replace(self, job: str, profile_due: bool, since: float | None, marked: int | None,
                 slack: float | None) -> None:
        """Re-placement from the job's measured profile (every `profile_steps` steps, from its
        events since `since`): when the placer moves it, the job migrates here, between its
        steps, and resumes on its new phase. The step it starts there is marked on its new
        group (its step mark went to `marked`), so that its waits count from the start."""
        models = self.models.memory(self.routes.models_of(job))
        events = self.events(job, since) if profile_due else None
        decided = self.plane.on_step(job, models, events)
        if decided is None:
            return
        group, shift_s = decided
        self.migrate(job, group)
        time.sleep(shift_s)
        if group != marked and slack is not None:
            self._mark_on_node(group, job, slack)

    def migrate(self, job: str, group: int) -> None:
        """Move every model of `job` to node group `group` through the checkpoint directory:
        trainable ones saved (with their optimizer) after their last call, then added on the new
        node and loaded; samplers synced again. Counted in metrics()["migrations"]."""
        source = self.plane.placement(job)
        if source is None or source == group:
            return
        models = self.routes.models_of(job)
        saves = [self.submit(h, "save_state", CheckpointPayload(str(self.checkpoint_path(h, "migration")), True))
                 for h in models if h.trainable]
        for save in saves:
            save.result()
        inputs = self.plane.restore_inputs(job)
        remote.get(self.nodes[source].remove_job.remote(job))
        self.plane.migrated(job, source, group, [h.state_id for h in models])
        self._reinstate(job, group, inputs)
