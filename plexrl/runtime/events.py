"""The event log: one JSON object per request arrival, dispatch, start, end and per transition.

Times are seconds since the cluster started. Kept in memory (for `cluster.events()` and online
profiling) and, when a path is given, appended to a JSON-lines file as they happen.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path


class EventLog:
    def __init__(self, path: str | Path | None = None):
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self.path = Path(path) if path is not None else None
        self._file = None

    def emit(self, t: float, event: str, **fields) -> None:
        record = {"t": round(t, 9), "event": event, **fields}
        with self._lock:
            self._events.append(record)
            if self.path is not None:
                if self._file is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._file = self.path.open("a", encoding="utf-8", buffering=1)  # line-buffered: tail -f works
                self._file.write(json.dumps(record) + "\n")

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self._events)

    def write(self, path: str | Path) -> Path:
        return write_jsonl(self.snapshot(), path)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def job_events(records: list[dict], job: str | None) -> list[dict]:
    """The records of `job` (all of them when `job` is None)."""
    return records if job is None else [r for r in records if r.get("job") == job]


def write_jsonl(records: list[dict], path: str | Path) -> Path:
    """Event records as JSON lines (what `plexrl sim calibrate` and the plots read)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path
