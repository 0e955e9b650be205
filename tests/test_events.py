"""The event log (runtime/events.py): each job's records kept on their own, the window a profile
reads, and a memory bound for a service that runs for days (the file keeps every record)."""

from __future__ import annotations

import json

import pytest

from plexrl.runtime.events import EventLog


def fill(log: EventLog, n: int) -> None:
    for i in range(n):
        log.emit(float(i), "end", job="ab"[i % 2], request_id=i)


def test_a_jobs_records_are_the_logs_records_of_that_job():
    log = EventLog()
    fill(log, 7)
    log.emit(7.0, "node_lost", group=0)  # no job: only in the whole log
    whole = log.snapshot()
    assert len(whole) == 8
    for job in "ab":
        assert log.snapshot(job) == [r for r in whole if r.get("job") == job]
    assert log.snapshot("nobody") == []


def test_a_window_of_a_job_keeps_its_requests_still_going():
    log = EventLog()
    log.emit(0.0, "arrival", job="a", request_id=1)
    log.emit(1.0, "end", job="a", request_id=0)
    log.emit(2.0, "step", job="a", step=1)
    log.emit(3.0, "end", job="a", request_id=1)
    assert [r["t"] for r in log.snapshot("a", since=2.0)] == [0.0, 2.0, 3.0]


@pytest.mark.parametrize("keep", [1, 2, 5, 10])
def test_memory_holds_at_most_keep_records_and_the_file_every_one(tmp_path, keep):
    log = EventLog(tmp_path / "events.jsonl", keep=keep)
    for i in range(25):
        log.emit(float(i), "end", job="ab"[i % 2], request_id=i)
        whole = log.snapshot()
        assert 1 <= len(whole) <= keep
        assert [r["request_id"] for r in whole] == list(range(i + 1 - len(whole), i + 1))  # the newest, in order
        for job in "ab":
            assert log.snapshot(job) == [r for r in whole if r["job"] == job]
    log.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == list(range(25))


def test_keep_must_be_positive():
    with pytest.raises(ValueError, match="keep must be None"):
        EventLog(keep=0)
