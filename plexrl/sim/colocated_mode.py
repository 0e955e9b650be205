"""Colocated baseline: each job owns `tp * dp` GPUs for its whole run; phases alternate on them.

The job's states share its own GPUs (offloading only if they do not fit together, as verl's
hybrid engine does), and it is charged for the reserved GPUs times its wall time, idle or not.
GPUs are counted cluster-wide (no node fragmentation), which favours this baseline.
"""

from __future__ import annotations

import math

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


class AloneMode(ColocatedMode):
    """A bound, not a schedule: every job on GPUs of its own from its arrival, however many the
    jobs ask for at once (colocated's placement without its limit on GPUs, and like it counting
    GPUs cluster-wide). No job queues or shares, so no mode whose jobs never run faster
    than alone completes more steps by a horizon, a lower mean JCT, or a shorter makespan
    (then the report's `makespan_floor_s`): `plexrl sim W --modes colocated,plexrl,alone`
    shows how much of that headroom a mode takes. Its figures that divide by the cluster's
    GPUs (utilisation, cluster GPU-hours per step, capacity vs colocated) count the
    cluster's, so utilisation may pass 100% while the jobs ask for more than the cluster has,
    and capacity vs colocated is its steps (by a horizon) or its pace over colocated's."""

    name = "alone"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.free_gpus = math.inf
