"""Shared output for benchmarks: one JSON object with --json, else a rich table."""

from __future__ import annotations

import json
import statistics
from typing import Callable


def emit(title: str, result: dict, as_json: bool, table: Callable[[dict], None] | None = None) -> None:
    """`result` as one JSON object, or printed by `table` (default: a figure/value table titled `title`)."""
    if as_json:
        print(json.dumps(result, sort_keys=True))
        return
    if table is not None:
        table(result)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    Console().print(table)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def median(values: list[float]) -> float:
    return statistics.median(values)
