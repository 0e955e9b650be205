"""The Ray engine: the one runtime (runtime/front.py) with its pieces as Ray actors, across nodes.

    RayCluster (the front: in the driver, or attached from a job's controller actor)
      ├ <name>-control actor, on the driver's node (the control plane)
      └ per node (NodeAffinitySchedulingStrategy): <name>-node<g> actor (Node: StateManager + group scheduler)
                                                   <name>-worker<d> actor per device (num_gpus=1, max_restarts=-1)

What only Ray has: a node can be lost alone (its jobs are re-placed and restored from their
latest checkpoints, runtime/recovery.py), and a job's controller in another process can join a
running cluster by name (`RayCluster.attach`).
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from plexrl.api import errors
from plexrl.engines import ray_setup
from plexrl.runtime.config import ClusterConfig
from plexrl.runtime.control import CONTROL_THREADS, Control
from plexrl.runtime.control_plane import ControlClient
from plexrl.runtime.device_worker import DeviceWorker
from plexrl.runtime.front import Front, piece_name
from plexrl.runtime.node import Call, Node, NodeConfig

DeviceWorkerActor = ray.remote(DeviceWorker)
NodeActor = ray.remote(Node)
ControlActor = ray.remote(Control)
NODE_CALL_THREADS = 256  # calls block a node thread while queued; more than any test or job keeps in flight


class RayCluster(Front):
    """`RayCluster(address=None | "auto" | "ray://...", nodes=None, devices_per_node=2, **settings)`:
    `nodes` Ray nodes with `devices_per_node` GPUs each (all such nodes when None); `settings`
    are runtime.config.ClusterConfig's. `RayCluster.attach(name)` joins a running one."""

    engine = "ray"

    def __init__(self, address: str | None = None, nodes: int | None = None, devices_per_node: int = 2,
                 name: str | None = None, **settings):
        self._owns_ray = address is None and not ray.is_initialized()
        ray_setup.connect(address, num_gpus=devices_per_node)
        found = ray_setup.gpu_nodes(devices_per_node)
        nodes = len(found) if nodes is None else nodes
        if not 1 <= nodes <= len(found):
            raise errors.ConfigError(f"nodes={nodes}; expected 1..{len(found)} (Ray nodes with {devices_per_node} GPUs)")
        self._ray_nodes = [node_id for node_id, _ in found[:nodes]]
        super().__init__(ClusterConfig.of(None, nodes, devices_per_node, **settings), name)

    @classmethod
    def attach(cls, name: str) -> "RayCluster":
        """A front on the running cluster `name` (its actors are found by name in this Ray job's
        namespace): the same API, for a controller in another process."""
        try:
            control = ray.get_actor(piece_name(name, "control"))
        except ValueError:
            raise errors.ConfigError(f"no PlexRL cluster named {name!r} in this Ray namespace") from None
        description = ControlClient(control).describe()
        front = cls.__new__(cls)
        front._owns_ray, front._owned, front._tmp, front.name = False, [], None, name
        nodes = [ray.get_actor(piece_name(name, "node", g)) for g in range(len(description.node_ids))]
        workers = {d: ray.get_actor(piece_name(name, "worker", d)) for d in range(description.config.devices)}
        front._join(description, control, nodes, workers)
        return front

    # -- hosting -------------------------------------------------------------------------------
    def _find_nodes(self, config: ClusterConfig) -> list:
        return self._ray_nodes

    def _host_worker(self, node_id: str, name: str, args: tuple):
        pinned = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return DeviceWorkerActor.options(num_gpus=1, num_cpus=0, max_restarts=-1, scheduling_strategy=pinned,
                                         name=name).remote(*args)

    def _host_node(self, node_id: str, name: str, config: NodeConfig):
        pinned = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return NodeActor.options(num_cpus=0, max_concurrency=NODE_CALL_THREADS, scheduling_strategy=pinned,
                                 name=name).remote(config)

    def _host_control(self, name: str, args: tuple):
        """On the driver's node: the control plane lives as long as the process that started the cluster."""
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return ControlActor.options(num_cpus=0, max_concurrency=CONTROL_THREADS, name=name,
                                    scheduling_strategy=here).remote(*args)

    def _send(self, group: int, call: Call, future=None):
        return self.nodes[group].call.remote(call)

    def _torch_device(self, setting: str) -> str:
        """Kept as set: each worker actor resolves it where it runs ("auto": its GPU when Ray gave
        it a real one), since the driver's machine may have no GPU of its own."""
        return setting

    def _check_gpus(self, config, torch_device: str) -> None:
        """Nothing here: Ray gives each worker a GPU of its own (num_gpus=1), on its own machine."""

    def _device_name(self, torch_device: str, index: int) -> str:
        return torch_device  # Ray shows each worker actor only its own GPU (num_gpus=1): "cuda" is that one

    def _is_node_loss(self, exc: BaseException) -> bool:
        """A node actor died (errors of its calls arrive wrapped, never as ActorDiedError)."""
        return isinstance(exc, ray.exceptions.ActorDiedError)

    def close(self) -> None:
        super().close()
        if self._owns_ray:
            ray.shutdown()
