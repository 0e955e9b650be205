"""Cluster simulator: the paper's evaluation at cluster scale on the same policy code.

`simulate(load_workload("paper-mix"), load_cluster("h200-256"))` runs every mode; `plexrl sim`
is the command line. Only execution is modelled (`latency.py`); decisions come from
`plexrl.policy`.
"""

from plexrl.sim.simulate import MODES, simulate
from plexrl.sim.workload import WorkloadJob, SimCluster, Workload, load_cluster, load_workload

__all__ = ["MODES", "WorkloadJob", "SimCluster", "Workload", "load_cluster", "load_workload", "simulate"]
