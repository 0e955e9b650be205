"""The event log: one JSON object per request arrival, dispatch, start, end and per transition.

Times are seconds since the cluster started. Kept in memory (for `cluster.events()` and online
profiling) and, when a path is given, appended to a JSON-lines file as they happen. Each job's
records are also kept on their own, so what one job's profile reads (`snapshot(job, since)`)
costs that job's records, not every tenant's, and only its recent window travels. With `keep`
(a service that runs for days), memory holds at most that many records: past it the oldest half
goes, from the whole log and from each job's records alike; the file keeps every record.
Every record also goes by the log's `Activity` (activity.py): histograms, queues and device lanes,
which stay bounded whatever `keep` is.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

from plexrl.policy.profile import window
from plexrl.runtime.activity import Activity


class EventLog:
    def __init__(self, path: str | Path | None = None, keep: int | None = None):
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be None (every record) or a positive number of records, got {keep}")
        self._events: list[dict] = []
        self._by_job: dict[str, list[dict]] = {}
        self.keep = keep
        self._lock = threading.Lock()
        self.path = Path(path) if path is not None else None
        self._file = None
        self.activity = Activity()

    def emit(self, t: float, event: str, **fields) -> None:
        record = {"t": round(t, 9), "event": event, **fields}
        with self._lock:
            self._events.append(record)
            self.activity.observe(record)
            job = fields.get("job")
            if isinstance(job, str):
                self._by_job.setdefault(job, []).append(record)
            if self.keep is not None and len(self._events) > self.keep:
                self._forget_oldest(len(self._events) - max(1, self.keep // 2))
            if self.path is not None:
                if self._file is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._file = self.path.open("a", encoding="utf-8", buffering=1)  # line-buffered: tail -f works
                self._file.write(json.dumps(record) + "\n")

    def _forget_oldest(self, n: int) -> None:
        """Drop the `n` oldest records (in the order they came): each job's list loses as many of
        its first ones as it had among them. Amortised O(1) a record: it runs once per keep / 2."""
        gone = Counter(r.get("job") for r in self._events[:n])
        del self._events[:n]
        for job, count in gone.items():
            mine = self._by_job.get(job)  # None for records without a job
            if mine is not None:
                del mine[:count]
                if not mine:
                    del self._by_job[job]

    def snapshot(self, job: str | None = None, since: float | None = None) -> list[dict]:
        """The records kept (`job`'s only, when given); with `since`, those from `since` on and
        the earlier ones of requests that have records from then on, what a profile of the steps
        from `since` on reads (`profile.window`)."""
        with self._lock:
            records = list(self._events if job is None else self._by_job.get(job, ()))
        return records if since is None else window(records, since)

    def activity_summary(self) -> dict:
        with self._lock:
            return self.activity.summary()

    def recent(self, since: float) -> dict:
        """Per device, its spans ending at `since` or later, and each job's span (`Activity.recent`)."""
        with self._lock:
            return self.activity.recent(since)

    def write(self, path: str | Path) -> Path:
        return write_jsonl(self.snapshot(), path)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def write_jsonl(records: list[dict], path: str | Path) -> Path:
    """Event records as JSON lines (what `plexrl sim calibrate` and the plots read)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path
