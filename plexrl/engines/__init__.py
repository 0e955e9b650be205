"""Engines host the one runtime (plexrl/runtime/front.py) somewhere (docs/design.md §8); they never
re-implement a piece. Importing this package imports neither torch nor Ray; each engine is
loaded on first use, and only the Ray engine imports Ray.

- "local": `LocalCluster`, one process, device workers on the nodes' threads;
- "process": `ProcessCluster`, an OS process per device on this machine (no Ray);
- "ray": `RayCluster`, a Ray actor per device, per node and for the control plane, across machines.

`session(engine, devices)` and `open_cluster(engine, ...)` are how commands (`plexrl demo`,
`plexrl run`) pick an engine by name. A fourth engine is a module here with a `Front` subclass
that says where each piece runs (`_host_worker`, `_host_node`, `_host_control`) and what its
devices are (`_torch_device`, `_check_gpus`, `_device_name`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

__all__ = ["ENGINES", "LocalCluster", "ProcessCluster", "RayCluster", "open_cluster", "session"]

ENGINES = {"local": ("plexrl.engines.local", "LocalCluster"),
           "process": ("plexrl.engines.process", "ProcessCluster"),
           "ray": ("plexrl.engines.ray_engine", "RayCluster")}


def engine_class(engine: str) -> type:
    import importlib

    module, name = ENGINES[check_engine(engine)]
    return getattr(importlib.import_module(module), name)


def __getattr__(name: str):
    for engine, (_, cls) in ENGINES.items():
        if cls == name:
            return engine_class(engine)
    raise AttributeError(f"module 'plexrl.engines' has no attribute {name!r}")


def add_engine_option(parser) -> None:
    """`--engine NAME`, `--device auto|cpu|cuda` (ClusterConfig.torch_device) and `--precision
    auto|fp32|bf16` (ClusterConfig.precision) for a command that opens clusters (argparse)."""
    parser.add_argument("--engine", default="process", choices=list(ENGINES),
                        help="process: a process per device (default); local: one process, device workers on "
                             "threads; ray: Ray actors per device and node")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="what a device is: auto (default) a GPU when CUDA is present, else a CPU core; "
                             "cuda: GPUs, refused without one")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                        help="auto (default): bf16 on CUDA devices, fp32 on CPU; bf16: bfloat16 sampler snapshots "
                             "and frozen models, trainers in mixed precision (float32 master weights and moments)")


def check_engine(engine: str) -> str:
    if engine not in ENGINES:
        from plexrl.errors import ConfigError

        raise ConfigError(f"engine={engine!r}; expected one of {list(ENGINES)}")
    return engine


@contextmanager
def session(engine: str, devices: int) -> Iterator[None]:
    """Around every cluster a command opens: on Ray, one local Ray instance with `devices` logical
    GPUs on its node (clusters of fewer devices use some of them), shut down at the end. Joining
    an existing Ray cluster instead: set RAY_ADDRESS."""
    check_engine(engine)
    if engine != "ray":
        yield
        return
    import os

    import ray

    from plexrl.engines import ray_setup

    owned = not ray.is_initialized()
    ray_setup.connect(os.environ.get("RAY_ADDRESS"), num_gpus=devices)
    try:
        yield
    finally:
        if owned:
            ray.shutdown()


def open_cluster(engine: str, devices: int, **settings):
    """A cluster of `devices` devices on one node group, on the named engine; `settings`:
    runtime.config.ClusterConfig's (device_memory_bytes, host_memory_bytes, policy, workdir, ...)."""
    if check_engine(engine) == "ray":
        return engine_class(engine)(nodes=1, devices_per_node=devices, **settings)
    return engine_class(engine)(devices=devices, **settings)
