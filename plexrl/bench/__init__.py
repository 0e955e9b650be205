"""`plexrl bench NAME`: benchmarks reported against their physical reference measured in the same run."""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "switch": "plexrl.bench.switch",
    "prefetch": "plexrl.bench.prefetch",
    "sample": "plexrl.bench.sample",
    "dispatch": "plexrl.bench.dispatch",
    "placement": "plexrl.bench.placement",
    "scale": "plexrl.bench.scale",
    "cotenancy": "plexrl.bench.cotenancy",
    "faults": "plexrl.bench.faults",
    "serve": "plexrl.bench.serve",
    "observe": "plexrl.bench.observe",
    "ray": "plexrl.engines.ray_bench",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print(f"usage: plexrl bench {{{','.join(BENCHES)}}} [--json]", file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHES[argv[0]]).main(argv[1:]) or 0)
