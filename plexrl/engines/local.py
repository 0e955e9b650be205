"""The local engine: every piece of the runtime in this process (docs/design.md §8).

    LocalCluster (the front) ─ Control (a thread pool)
                             └ per node group: Node (a thread pool: StateManager + group scheduler)
                                               DeviceWorker per device, run on its dispatcher thread

The single-process host of the one runtime (runtime/front.py): for tests and debugging. Device
workers of one interpreter take turns on its lock, so two CPU devices computing at once run one
after the other (the process engine runs them in parallel); results are the same.
"""

from __future__ import annotations

from plexrl.engines.hosting import InlineActor, ThreadActor
from plexrl.runtime.config import ClusterConfig
from plexrl.runtime.control import CONTROL_THREADS, Control
from plexrl.runtime.device_worker import DeviceWorker
from plexrl.runtime.front import Front
from plexrl.runtime.node import Node, NodeConfig

NODE_CALL_THREADS = 64  # a node's calls that may wait (adding a model, removing a job); calls queue directly


class LocalCluster(Front):
    """`LocalCluster(devices=2, nodes=1, devices_per_node=None, **settings)`: `devices` in all,
    split over `nodes` node groups; `settings` are runtime.config.ClusterConfig's."""

    engine = "local"
    devices_share_a_process = True

    def __init__(self, devices: int | None = None, nodes: int = 1, devices_per_node: int | None = None,
                 name: str | None = None, **settings):
        super().__init__(ClusterConfig.of(devices, nodes, devices_per_node, **settings), name)

    def _host_worker(self, node_id, name: str, args: tuple):
        return InlineActor(DeviceWorker(*args), name)

    def _host_node(self, node_id, name: str, config: NodeConfig):
        return ThreadActor(Node(config), NODE_CALL_THREADS, name)

    def _host_control(self, name: str, args: tuple):
        return ThreadActor(Control(*args), CONTROL_THREADS, name)

    def _torch_device(self, setting: str) -> str:
        """ClusterConfig.torch_device as the workers get it: resolved here ("auto": CUDA when this
        process sees a GPU), where the workers run on this machine."""
        from plexrl.runtime.cuda import resolve_device

        return resolve_device(setting)

    def _check_gpus(self, config: ClusterConfig, torch_device: str) -> None:
        """On CUDA, the logical devices' budgets fit the GPUs this process sees, which they share
        round robin (runtime/cuda.py: check_gpus_hold); nothing to check on CPU."""
        if not torch_device.startswith("cuda"):
            return
        import torch

        from plexrl.runtime.cuda import check_gpus_hold

        gpus = [torch.cuda.get_device_properties(i).total_memory for i in range(max(1, torch.cuda.device_count()))]
        check_gpus_hold(config.devices, config.device_memory_bytes, gpus)

    def _device_name(self, torch_device: str, index: int) -> str:
        """Device `index`'s torch device: logical devices share the GPUs this process sees."""
        if torch_device != "cuda":
            return torch_device
        import torch

        return f"cuda:{index % max(1, torch.cuda.device_count())}"
