"""The process engine: one OS process per device on this machine, no Ray.

    ProcessCluster (the front) ─ Control (a thread pool in this process)
                               └ per node group: Node (a thread pool in this process)
                                                 DeviceWorker per device in its own process, pinned to a core

The one runtime (runtime/front.py) with device workers in processes of their own
(engines/hosting.py). Why: on a CPU machine, worker *threads* of one interpreter take turns on
its lock — two devices decoding at once run one after the other, and every call pays lock
hand-offs with the job controllers. Worker processes compute in parallel and are charged their
own CPU time only. Calls cost a pipe round trip (~0.1 ms).

Failures: a worker process that dies fails its in-flight call with WorkerFailed (retriable), is
restarted, and its states come back from their host copies (write-through).
"""

from __future__ import annotations

import os

from plexrl.engines.hosting import ProcessActor
from plexrl.engines.local import LocalCluster
from plexrl.runtime.device_worker import DeviceWorker


class ProcessCluster(LocalCluster):
    """`ProcessCluster(devices=2, nodes=1, devices_per_node=None, **settings)`, as LocalCluster."""

    engine = "process"

    def _host_worker(self, node_id, name: str, args: tuple):
        """Device d's process is pinned to one core (d-th of this process's, round robin): a CPU
        "device" computes on its own core, as a GPU does, instead of migrating between cores."""
        if not hasattr(os, "sched_getaffinity"):  # not Linux: leave placement to the OS
            return ProcessActor(DeviceWorker, args, name)
        cores = sorted(os.sched_getaffinity(0))
        return ProcessActor(DeviceWorker, (*args, (cores[args[0] % len(cores)],)), name)
