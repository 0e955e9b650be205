"""The cluster as the placer sees it: pods -> node groups -> nodes -> devices, and who sits where.

Topology is frozen data (`NodeResources`, `NodeGroup`); occupancy (host bytes committed per node, jobs
per device) lives in numpy arrays inside `ResourceView` so that checking 256 groups is a few
vector operations.

Memory rule (our design, docs/design.md §4): devices of a group are time-shared, and a state is made
resident only when it runs, evicting others from the arena. So device memory is a per-state
check: every model of a job must fit one device arena on its own (`JobProfile.device_bytes`
<= the device's budget). Host memory is what is really committed: each of a job's devices
gets a copy of its own models' host buffers on that device's node, and the sum committed on a
node never exceeds the node's host bytes. A shared frozen model (`ModelMemory.shared`,
docs/design.md §4) is one copy per node, committed when the first job naming it lands on the node and freed
when the last one leaves (refcounted). Invariant (tested): `host_used <= host_bytes` on every
node, always, and a shared copy is counted once per node however many jobs use it.

A job whose model replicas span several devices (`JobProfile.replica_devices`, tensor
parallelism) takes whole replicas per node: a node's devices count for it in multiples of that.

Which groups fit a job is one vector pass over the cluster's nodes (copies each node could
take, summed per group), microseconds at thousands of devices. A bound per pod (too few
devices, arenas too small, no node with room for one copy) would only skip groups this pass
already rules out (a group that fits passes it), so none is taken: it cost more than it saved.

Rows: the placer keeps one row of projected load per device, in topology order (group by
group, node by node), so a node's devices and a group's devices are contiguous row ranges
(`node_rows`, `group_rows`); `device_rows` maps device ids to rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from plexrl.policy.profile import JobProfile


@dataclass(frozen=True)
class NodeResources:
    name: str
    devices: tuple[int, ...]  # cluster-wide device ids
    device_bytes: int  # arena budget of each device
    host_bytes: int


@dataclass(frozen=True)
class NodeGroup:
    name: str
    pod: str
    nodes: tuple[NodeResources, ...]

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for node in self.nodes for d in node.devices)


def _fmt_bytes(n: float) -> str:
    return f"{int(n)} bytes ({n / 2**30:.2f} GiB)"


class ResourceView:
    """Topology plus occupancy. Groups keep their given order; that order breaks ties."""

    def __init__(self, groups: Sequence[NodeGroup]):
        if not groups:
            raise ValueError("a ResourceView needs at least one node group")
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"node group names must be unique, got {names}")
        self.groups = tuple(groups)
        self.index = {g.name: i for i, g in enumerate(self.groups)}
        nodes = [(gi, node) for gi, g in enumerate(self.groups) for node in g.nodes]
        self.nodes = tuple(node for _, node in nodes)
        self.node_group = np.array([gi for gi, _ in nodes], dtype=np.int64)
        self.node_devices = np.array([len(n.devices) for n in self.nodes], dtype=np.int64)
        self.node_arena = np.array([n.device_bytes for n in self.nodes], dtype=np.int64)
        self.node_host = np.array([n.host_bytes for n in self.nodes], dtype=np.int64)
        self.host_used = np.zeros(len(self.nodes), dtype=np.int64)
        self.group_first_node = np.searchsorted(self.node_group, np.arange(len(self.groups)))
        self.capacity = np.array([len(g.devices) for g in self.groups], dtype=float)
        self.device_jobs: dict[int, int] = {d: 0 for g in self.groups for d in g.devices}
        self._node_of = {d: n for n, node in enumerate(self.nodes) for d in node.devices}
        first_row = np.concatenate(([0], np.cumsum(self.node_devices)))
        self.node_rows = tuple((int(a), int(b)) for a, b in zip(first_row[:-1], first_row[1:]))
        first_node = [int(n) for n in self.group_first_node]
        self.group_rows = tuple(
            (self.node_rows[n][0], self.node_rows[n + len(grp.nodes) - 1][1]) for n, grp in zip(first_node, self.groups)
        )
        self.row_device = np.array([d for node in self.nodes for d in node.devices], dtype=np.int64)
        self.device_rows = {int(d): r for r, d in enumerate(self.row_device)}
        self.row_node = np.repeat(np.arange(len(self.nodes)), self.node_devices)  # the node of each row
        self.row_group = self.node_group[self.row_node]  # the group of each row
        self._held: dict[str, tuple[tuple[int, ...], np.ndarray, dict[str, int], tuple[int, ...]]] = {}
        # job -> (devices, own host bytes per node, shared copies it uses, the nodes it is on)
        self._shared: list[dict[str, list[int]]] = [{} for _ in self.nodes]  # node -> key -> [bytes, users]

    @classmethod
    def uniform(
        cls, pods: int, groups_per_pod: int, nodes_per_group: int, devices_per_node: int,
        device_bytes: int, host_bytes: int,
    ) -> "ResourceView":
        """A homogeneous cluster; device ids count up through pods, groups and nodes."""
        groups, next_device = [], 0
        for p in range(pods):
            for g in range(groups_per_pod):
                nodes = []
                for n in range(nodes_per_group):
                    devices = tuple(range(next_device, next_device + devices_per_node))
                    next_device += devices_per_node
                    nodes.append(NodeResources(f"pod{p}/g{g}/n{n}", devices, device_bytes, host_bytes))
                groups.append(NodeGroup(f"pod{p}/g{g}", f"pod{p}", tuple(nodes)))
        return cls(groups)

    # -- feasibility ---------------------------------------------------------------------------

    def copies_per_node(self, profile: JobProfile) -> np.ndarray:
        """How many of the job's devices each node could take, by arena size and free host memory."""
        per_copy = profile.host_bytes_per_device
        free = self.node_host - self.host_used - self._shared_missing(profile)
        by_host = np.where(free < 0, 0, free // per_copy if per_copy > 0 else self.node_devices)
        fits_arena = self.node_arena >= profile.device_bytes
        return np.where(fits_arena, np.minimum(self.node_devices, by_host), 0)

    def _shared_missing(self, profile: JobProfile) -> np.ndarray | int:
        """Per node, the host bytes of the job's shared models not yet on it (0 without any)."""
        shared = profile.shared_host_bytes
        if not shared:
            return 0
        return np.array([sum(n for key, n in shared.items() if key not in on_node) for on_node in self._shared],
                        dtype=np.int64)

    def shared_copies(self, node: int) -> dict[str, int]:
        """Shared models held on node `node`: key -> the number of jobs using its one copy."""
        return {key: users for key, (_, users) in self._shared[node].items()}

    def units_per_node(self, profile: JobProfile) -> np.ndarray:
        """How many whole replicas of the job each node could take (`copies_per_node` in units
        of `replica_devices`)."""
        return self.copies_per_node(profile) // profile.replica_devices

    def feasible_groups(self, profile: JobProfile) -> np.ndarray:
        """Indices (ascending) of the groups where the job's memory fits."""
        copies = self.units_per_node(profile) * profile.replica_devices
        return np.flatnonzero(np.add.reduceat(copies, self.group_first_node) >= profile.devices)

    def shortfall(self, profile: JobProfile) -> str:
        """Why no group fits the job's memory, naming the resource that is short."""
        need = profile.devices
        if self.capacity.max() < need:
            return f"no node group has {need} devices: the largest has {int(self.capacity.max())}"
        if self.node_arena.max() < profile.device_bytes:
            big = max(profile.models, key=lambda m: m.device_bytes)
            return (
                f"no device arena can hold model {big.name!r} of job {profile.job!r}: needs "
                f"{_fmt_bytes(big.device_bytes)}, the largest arena has {_fmt_bytes(self.node_arena.max())}"
            )
        big_enough = self.node_arena >= profile.device_bytes
        usable = np.add.reduceat(np.where(big_enough, self.node_devices, 0), self.group_first_node)
        if usable.max() < need:
            return (
                f"no node group has {need} devices whose arena holds {_fmt_bytes(profile.device_bytes)} "
                f"(the largest model of job {profile.job!r}): the best group has {int(usable.max())}"
            )
        per_copy = profile.host_bytes_per_device
        # usable room: whole copies only, so a fragmented group reports what it can really take
        room = self.copies_per_node(profile) * per_copy
        best = int(np.add.reduceat(room, self.group_first_node).max())
        return (
            f"no node group has {need} free devices' worth of host memory: job {profile.job!r} needs "
            f"{_fmt_bytes(need * per_copy)} ({need} x {per_copy}), the best group has {_fmt_bytes(best)}"
        )

    # -- occupancy -----------------------------------------------------------------------------

    def choose_devices(self, group: int, profile: JobProfile) -> tuple[int, ...]:
        """The job's devices in `group`: nodes with the most free host first, then the devices
        with the fewest jobs, so copies spread and host memory stays balanced."""
        copies = self.units_per_node(profile) * profile.replica_devices
        first = self.group_first_node[group]
        order = sorted(range(first, first + len(self.groups[group].nodes)),
                       key=lambda n: (-(self.node_host[n] - self.host_used[n]), n))
        chosen: list[int] = []
        for n in order:
            take = min(int(copies[n]), profile.devices - len(chosen))
            by_jobs = sorted(self.nodes[n].devices, key=lambda d: (self.device_jobs[d], d))
            chosen.extend(by_jobs[:take])
            if len(chosen) == profile.devices:
                return tuple(sorted(chosen))
        raise ValueError(
            f"job {profile.job!r} does not fit node group {self.groups[group].name!r}: "
            f"needs {profile.devices} devices with host room, found {len(chosen)}"
        )

    def allocate(self, job: str, devices: Sequence[int], host_bytes_per_device: int,
                 shared: dict[str, int] | None = None) -> None:
        """Commit the job's host buffers to the nodes of `devices`, and one copy per node of
        each `shared` model (key -> bytes) that is not there yet; refuses to over-commit."""
        if job in self._held:
            raise ValueError(f"job {job!r} already holds resources; release it first")
        unknown = [d for d in devices if d not in self._node_of]
        if unknown:
            raise ValueError(f"job {job!r}: unknown devices {unknown}")
        shared = dict(shared or {})
        per_node = np.bincount([self._node_of[d] for d in devices], minlength=len(self.nodes))
        nodes = tuple(int(n) for n in np.flatnonzero(per_node))
        added = per_node * host_bytes_per_device
        copies = np.zeros(len(self.nodes), dtype=np.int64)
        for n in nodes:
            copies[n] = sum(nbytes for key, nbytes in shared.items() if key not in self._shared[n])
        over = np.flatnonzero(self.host_used + added + copies > self.node_host)
        if len(over):
            n = over[0]
            raise ValueError(
                f"job {job!r} would over-commit host memory of node {self.nodes[n].name!r}: "
                f"{self.host_used[n] + added[n] + copies[n]} > {self.node_host[n]} bytes"
            )
        self.host_used += added + copies
        for n in nodes:
            for key, nbytes in shared.items():
                self._shared[n].setdefault(key, [nbytes, 0])[1] += 1
        for d in devices:
            self.device_jobs[d] += 1
        self._held[job] = (tuple(devices), added, shared, nodes)

    def free(self, job: str) -> None:
        """Give back what `job` holds; a job that holds nothing is a no-op. A shared copy is
        freed with the last job on its node that uses it."""
        devices, added, shared, nodes = self._held.pop(job, ((), 0, {}, ()))
        self.host_used -= added
        for n in nodes:
            for key in shared:
                held = self._shared[n][key]
                held[1] -= 1
                if held[1] == 0:
                    self.host_used[n] -= held[0]
                    del self._shared[n][key]
        for d in devices:
            self.device_jobs[d] -= 1
