"""Engines host the runtime's component classes somewhere other than one process (DESIGN §8).

`ray_*` modules: the Ray engine. Importing this package does not import Ray; `RayCluster` is
loaded on first use so CPU-only installs without a Ray cluster can still import plexrl.engines.

`session(engine, devices)` and `open_cluster(engine, ...)` are how commands (`plexrl demo`,
`plexrl run`) pick an engine by name; the same jobs run on
- "local": `LocalCluster`, one process, a thread per device (the single-process core);
- "process": `ProcessCluster`, an OS process per device on this machine (no Ray);
- "ray": `RayCluster`, a Ray actor per device and per node, across machines.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

__all__ = ["ENGINES", "ProcessCluster", "RayCluster", "open_cluster", "session"]

ENGINES = ("local", "process", "ray")


def __getattr__(name: str):
    if name == "RayCluster":
        from plexrl.engines.ray_cluster import RayCluster

        return RayCluster
    if name == "ProcessCluster":
        from plexrl.engines.process_cluster import ProcessCluster

        return ProcessCluster
    raise AttributeError(f"module 'plexrl.engines' has no attribute {name!r}")


def add_engine_option(parser) -> None:
    """`--engine NAME` for a command that opens clusters (argparse)."""
    parser.add_argument("--engine", default="process", choices=ENGINES,
                        help="process: a process per device (default); local: one process, a thread per "
                             "device; ray: Ray actors per device and node")


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


def open_cluster(engine: str, devices: int, **options):
    """A cluster of `devices` devices on one node group, on the named engine. `options`: what
    both engines take (device_memory_bytes, host_memory_bytes, policy, workdir, ...)."""
    check_engine(engine)
    if engine == "local":
        from plexrl.runtime.local_cluster import LocalCluster

        return LocalCluster(devices=devices, **options)
    if engine == "process":
        from plexrl.engines.process_cluster import ProcessCluster

        return ProcessCluster(devices=devices, **options)
    from plexrl.engines.ray_cluster import RayCluster

    return RayCluster(nodes=1, devices_per_node=devices, **options)
