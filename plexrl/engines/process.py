"""The process engine: one OS process per device on this machine, no Ray.

    ProcessCluster (the front) ─ Control (a thread pool in this process)
                               └ per node group: Node (a thread pool in this process)
                                                 DeviceWorker per device in its own process, pinned to a
                                                 core (CPU) or seeing only its own GPU (CUDA)

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
from plexrl.errors import ConfigError
from plexrl.runtime.device_worker import DeviceWorker


class ProcessCluster(LocalCluster):
    """`ProcessCluster(devices=2, nodes=1, devices_per_node=None, **settings)`, as LocalCluster."""

    engine = "process"
    devices_share_a_process = False

    def __init__(self, devices: int | None = None, nodes: int = 1, devices_per_node: int | None = None,
                 name: str | None = None, first_device: int = 0, **settings):
        """`first_device`: the machine's devices (cores, GPUs) this cluster's devices take, from
        that one on, round robin; two clusters given different ones compute side by side."""
        if isinstance(first_device, bool) or not isinstance(first_device, int) or first_device < 0:
            raise ConfigError(f"first_device={first_device!r}; expected a whole number >= 0 (a device of this machine)")
        self._first_device = first_device
        super().__init__(devices, nodes, devices_per_node, name, **settings)

    def _host_worker(self, node_id, name: str, args: tuple):
        """On CUDA, device d's process sees one GPU (`gpu_for(first_device + d)`) as cuda:0. On CPU
        it is pinned to one core (the (first_device + d)-th of this process's, round robin): a CPU
        "device" computes on its own core, as a GPU does, instead of migrating between cores."""
        device, torch_device = self._first_device + args[0], args[3]
        if torch_device.startswith("cuda"):
            return ProcessActor(DeviceWorker, args, name, env={"CUDA_VISIBLE_DEVICES": gpu_for(device)})
        if not hasattr(os, "sched_getaffinity"):  # not Linux: leave placement to the OS
            return ProcessActor(DeviceWorker, args, name)
        cores = sorted(os.sched_getaffinity(0))
        return ProcessActor(DeviceWorker, (*args, (cores[device % len(cores)],)), name)

    def _device_name(self, torch_device: str, index: int) -> str:
        return "cuda:0" if torch_device.startswith("cuda") else torch_device  # its process sees one GPU


def gpu_for(device: int, visible: str | None = None, count: int | None = None) -> str:
    """The GPU (as CUDA_VISIBLE_DEVICES names it) of device `device`'s process: one of the GPUs this
    process sees (`visible`, default its CUDA_VISIBLE_DEVICES; else `count` GPUs, default
    torch's count), round robin when there are more devices than GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is not None and visible.strip():
        ids = [part.strip() for part in visible.split(",") if part.strip()]
    else:
        if count is None:
            import torch

            count = torch.cuda.device_count()
        ids = [str(i) for i in range(max(1, count))]
    return ids[device % len(ids)]
