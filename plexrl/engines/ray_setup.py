"""Joining or starting a Ray cluster, and finding its nodes.

`address=None` starts a local Ray instance with `devices_per_node` logical GPUs (or reuses the
one this process already joined); "auto" or "ray://host:port" joins an existing cluster.
Defaults suit CI and laptops: no dashboard, no usage stats, a small object store, a short
private temp folder (Ray's socket paths must stay under ~100 characters).
"""

from __future__ import annotations

import os
import tempfile

import ray

from plexrl import errors

CI_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def connect(address: str | None, num_gpus: int, num_cpus: int | None = None,
            object_store_bytes: int = 100 << 20) -> None:
    for key, value in CI_ENV.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        return
    if address is None:
        ray.init(num_gpus=num_gpus, num_cpus=num_cpus, include_dashboard=False, object_store_memory=object_store_bytes,
                 _temp_dir=tempfile.mkdtemp(prefix="/tmp/r"), log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)


def gpu_nodes(devices_per_node: int | None) -> list[tuple[str, int]]:
    """(node id, logical GPUs) of each alive node with at least `devices_per_node` GPUs (any
    GPU when None), in a stable order. Raises ConfigError when there is none."""
    nodes = sorted((n["NodeID"], int(n["Resources"].get("GPU", 0))) for n in ray.nodes() if n["Alive"])
    need = devices_per_node or 1
    usable = [(node_id, gpus) for node_id, gpus in nodes if gpus >= need]
    if not usable:
        raise errors.ConfigError(
            f"no Ray node has {need} GPU(s) (nodes and their GPUs: {[g for _, g in nodes]}); start Ray with "
            "num_gpus (logical GPUs are fine on CPU machines) or lower devices_per_node")
    return usable
