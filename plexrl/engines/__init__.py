"""Engines host the runtime's component classes somewhere other than one process (DESIGN §8).

`ray_*` modules: the Ray engine. Importing this package does not import Ray; `RayCluster` is
loaded on first use so CPU-only installs without a Ray cluster can still import plexrl.engines.
"""

from __future__ import annotations

__all__ = ["RayCluster"]


def __getattr__(name: str):
    if name == "RayCluster":
        from plexrl.engines.ray_cluster import RayCluster

        return RayCluster
    raise AttributeError(f"module 'plexrl.engines' has no attribute {name!r}")
