"""What `plexrl serve` keeps across restarts: training runs, their checkpoints and their metadata.

Records live in SQLite (`STATE_DIR/plexrl.sqlite`, WAL mode); the weights of a checkpoint live in
a folder the runtime wrote (`STATE_DIR/checkpoints/TENANT/RUN/KIND/NAME`: a Hugging Face model
folder, or a LoRA adapter folder, plus `optimizer.safetensors` when saved with the optimizer).
A folder is moved into place before its record is written, and a record is deleted before its
folder, so a record always names a complete folder.

Every read and write takes the tenant: a record of another tenant is never returned (the
server answers 404 for it, as for a record that does not exist).

Safe to share between several servers on one machine (SQLite locks the file; WAL lets readers
run beside a writer). Sessions, models and futures are not here: they live in the server that
created them (see plexrl/serve/sessions.py, models.py, sampling.py, futures.py).
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("weights", "sampler_weights")  # tinker://RUN/KIND/NAME

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    base_model TEXT NOT NULL,
    lora_rank INTEGER NOT NULL,
    train_mlp INTEGER NOT NULL,
    train_attn INTEGER NOT NULL,
    train_unembed INTEGER NOT NULL,
    user_metadata TEXT,
    created REAL NOT NULL,
    last_request REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    tenant TEXT NOT NULL,
    folder TEXT NOT NULL,
    time REAL NOT NULL,
    size_bytes INTEGER NOT NULL,
    with_optimizer INTEGER NOT NULL,
    user_metadata TEXT,
    PRIMARY KEY (run_id, kind, name)
);
CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
"""


@dataclass(frozen=True)
class Run:
    run_id: str
    tenant: str
    base_model: str  # the served model name (a key of the server's --model table)
    lora_rank: int  # 0: full-parameter
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = False
    user_metadata: dict[str, Any] | None = None
    created: float = field(default_factory=time.time)
    last_request: float = field(default_factory=time.time)


@dataclass(frozen=True)
class CheckpointRecord:
    run_id: str
    kind: str  # "weights" or "sampler_weights"
    name: str
    tenant: str
    folder: str
    time: float
    size_bytes: int
    with_optimizer: bool
    user_metadata: dict[str, Any] | None = None

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"


class RunExists(Exception):
    """A run id that is already recorded (ids are unique; a record is never overwritten)."""


class Store:
    def __init__(self, state_dir: str | Path):
        self.root = Path(state_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "checkpoints").mkdir(exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.root / "plexrl.sqlite", check_same_thread=False, isolation_level=None,
                                   timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- ids --------------------------------------------------------------------------------------
    def next_number(self, name: str) -> int:
        """The next number of counter `name` (from 1), unique across restarts and across the
        servers that share this state directory (SQLite serialises the increment)."""
        with self._lock:
            (value,) = self._db.execute(
                "INSERT INTO counters VALUES (?, 1) ON CONFLICT(name) DO UPDATE SET value = value + 1 "
                "RETURNING value", (name,)).fetchone()
        return int(value)

    # -- runs -------------------------------------------------------------------------------------
    def add_run(self, run: Run) -> None:
        """Records a new run; a run id already recorded is refused (RunExists), never overwritten."""
        with self._lock:
            try:
                self._db.execute(
                    "INSERT INTO runs VALUES (?,?,?,?,?,?,?,?,?,?)",
                    (run.run_id, run.tenant, run.base_model, run.lora_rank, int(run.train_mlp), int(run.train_attn),
                     int(run.train_unembed), _dumps(run.user_metadata), run.created, run.last_request))
            except sqlite3.IntegrityError:
                raise RunExists(f"training run {run.run_id!r} is already recorded; a run id is never reused") from None

    def touch_run(self, run_id: str) -> None:
        with self._lock:
            self._db.execute("UPDATE runs SET last_request=? WHERE run_id=?", (time.time(), run_id))

    def run(self, tenant: str, run_id: str) -> Run | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM runs WHERE run_id=? AND tenant=?", (run_id, tenant)).fetchone()
        return None if row is None else _run(row)

    def runs(self, tenant: str, limit: int, offset: int) -> tuple[list[Run], int]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM runs WHERE tenant=? ORDER BY created DESC, run_id LIMIT ? OFFSET ?",
                                    (tenant, limit, offset)).fetchall()
            (total,) = self._db.execute("SELECT COUNT(*) FROM runs WHERE tenant=?", (tenant,)).fetchone()
        return [_run(row) for row in rows], int(total)

    # -- checkpoints ------------------------------------------------------------------------------
    def folder_for(self, tenant: str, run_id: str, kind: str, name: str) -> Path:
        return self.root / "checkpoints" / tenant / run_id / kind / name

    def add_checkpoint(self, record: CheckpointRecord, written: Path, overwrite: bool) -> CheckpointRecord:
        """Move the folder the runtime `written` into place and record it. An existing checkpoint
        of that name is replaced only with `overwrite` (else FileExistsError)."""
        target = Path(record.folder)
        with self._lock:
            exists = self._db.execute("SELECT 1 FROM checkpoints WHERE run_id=? AND kind=? AND name=?",
                                      (record.run_id, record.kind, record.name)).fetchone()
            if exists and not overwrite:
                shutil.rmtree(written, ignore_errors=True)
                raise FileExistsError(record.tinker_path)
            if exists:
                self._db.execute("DELETE FROM checkpoints WHERE run_id=? AND kind=? AND name=?",
                                 (record.run_id, record.kind, record.name))
            if target.exists():
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            written.rename(target)
            self._db.execute("INSERT INTO checkpoints VALUES (?,?,?,?,?,?,?,?,?)",
                             (record.run_id, record.kind, record.name, record.tenant, record.folder, record.time,
                              record.size_bytes, int(record.with_optimizer), _dumps(record.user_metadata)))
        return record

    def checkpoint(self, tenant: str, run_id: str, kind: str, name: str) -> CheckpointRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM checkpoints WHERE run_id=? AND kind=? AND name=? AND tenant=?",
                                   (run_id, kind, name, tenant)).fetchone()
        return None if row is None else _checkpoint(row)

    def checkpoints(self, tenant: str, run_id: str) -> list[CheckpointRecord]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM checkpoints WHERE run_id=? AND tenant=? ORDER BY time, name",
                                    (run_id, tenant)).fetchall()
        return [_checkpoint(row) for row in rows]

    def last_checkpoint(self, tenant: str, run_id: str, kind: str) -> CheckpointRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM checkpoints WHERE run_id=? AND kind=? AND tenant=? "
                                   "ORDER BY time DESC, name DESC LIMIT 1", (run_id, kind, tenant)).fetchone()
        return None if row is None else _checkpoint(row)

    def delete_checkpoint(self, tenant: str, run_id: str, kind: str, name: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT folder FROM checkpoints WHERE run_id=? AND kind=? AND name=? AND tenant=?",
                                   (run_id, kind, name, tenant)).fetchone()
            if row is None:
                return False
            self._db.execute("DELETE FROM checkpoints WHERE run_id=? AND kind=? AND name=?", (run_id, kind, name))
        shutil.rmtree(row[0], ignore_errors=True)
        return True


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _dumps(value: dict | None) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def _loads(value: str | None) -> dict | None:
    """A stored metadata object; one that does not decode (written by an older server, or torn)
    reads as None rather than breaking every listing it is in. Strings are kept as stored: the
    server answers in ASCII JSON, so even a lone surrogate goes out escaped."""
    if value is None:
        return None
    try:
        loaded = json.loads(value)
    except ValueError:
        return None
    return loaded if isinstance(loaded, dict) else None


def _run(row) -> Run:
    return Run(row[0], row[1], row[2], int(row[3]), bool(row[4]), bool(row[5]), bool(row[6]), _loads(row[7]),
               float(row[8]), float(row[9]))


def _checkpoint(row) -> CheckpointRecord:
    return CheckpointRecord(row[0], row[1], row[2], row[3], row[4], float(row[5]), int(row[6]), bool(row[7]),
                            _loads(row[8]))
