"""The process engine: one OS process per device on this machine, no Ray.

    ProcessCluster (driver: RayCluster's front, unchanged)
      ├ Control in the driver (placement, routing tables), called on threads
      └ per node group: RayNode in the driver (StateManager with shared-memory host buffers +
                        group scheduler), called on threads
                        DeviceWorker per device in its own spawned process (arena, modules)

The same classes as the Ray engine, hosted by engines/hosting.py instead of Ray. Why it exists:
on a CPU machine, worker *threads* of one interpreter take turns on its lock — two devices
decoding at once run one after the other, and every call pays lock hand-offs with the job
controllers. Worker processes compute in parallel and are charged their own CPU time only.
Calls cost a pipe round trip (~0.1 ms), not a Ray hop.

Failures as on Ray: a worker process that dies fails its in-flight call with WorkerFailed
(retriable), is restarted, and its states come back from their host copies (write-through).
"""

from __future__ import annotations

import os

from plexrl.engines.hosting import ProcessActor, ThreadActor
from plexrl.engines.ray_control import CONTROL_THREADS, Control
from plexrl.engines.ray_cluster import NODE_CALL_THREADS, RayCluster
from plexrl.engines.ray_node import RayNode
from plexrl.engines.ray_worker import DeviceWorker
from plexrl.errors import ConfigError


class ProcessCluster(RayCluster):
    """`ProcessCluster(devices=2, nodes=1, device_memory_bytes=..., host_memory_bytes=..., policy=...)`:
    `devices` per node group (each group its own StateManager, as the nodes of the Ray engine)."""

    engine = "process"

    def __init__(self, devices: int = 2, nodes: int = 1, **options):
        if "address" in options or "devices_per_node" in options:
            raise ConfigError("ProcessCluster runs on this machine: give devices= and nodes=, not address= "
                              "or devices_per_node= (those are RayCluster's)")
        super().__init__(None, nodes, devices, **options)

    def _find_nodes(self, address, nodes: int | None, per_node: int) -> list:
        nodes = 1 if nodes is None else nodes
        if nodes < 1:
            raise ConfigError(f"nodes={nodes}; expected at least 1")
        return [None] * nodes

    def _host_worker(self, node_id, name: str, args: tuple):
        """Device d's process is pinned to one core (d-th of this process's, round robin): a CPU
        "device" computes on its own core, as a GPU does, instead of migrating between cores."""
        if not hasattr(os, "sched_getaffinity"):  # not Linux: leave placement to the OS
            return ProcessActor(DeviceWorker, args, name)
        cores = sorted(os.sched_getaffinity(0))
        return ProcessActor(DeviceWorker, (*args, (cores[args[0] % len(cores)],)), name)

    def _host_node(self, node_id, name: str, args: tuple):
        return ThreadActor(RayNode(*args), NODE_CALL_THREADS, name)

    def _send(self, group: int, call: tuple):
        """The node runtime is in this process: queue the call directly (no thread waits on it)."""
        return self.nodes[group].target.enqueue(*call)

    def _host_control(self, name: str, args: tuple):
        return ThreadActor(Control(*args), CONTROL_THREADS, name)
