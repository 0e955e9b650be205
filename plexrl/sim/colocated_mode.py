"""Colocated baseline: each job owns `tp * dp` GPUs for its whole run; phases alternate on them.

The job's states share its own GPUs (offloading only if they do not fit together, as verl's
hybrid engine does), and it is charged for the reserved GPUs times its wall time, idle or not.
GPUs are counted cluster-wide (no node fragmentation), which favours this baseline.
"""

from __future__ import annotations

from plexrl.sim.phases import states_of
from plexrl.sim.runner import Mode
from plexrl.sim.service import SimJob


class ColocatedMode(Mode):
    name = "colocated"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.free_gpus = self.cluster.gpus

    def place(self, job: SimJob) -> bool:
        spec = job.spec
        if spec.gpus > self.free_gpus:
            return False
        workers = self.new_group(spec.gpus)
        for state in states_of(spec):
            self.attach(job, state, workers)
        self.free_gpus -= spec.gpus
        return True

    def release(self, job: SimJob) -> None:
        self.free_gpus += job.spec.gpus
