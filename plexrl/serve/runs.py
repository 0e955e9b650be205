"""A tenant's training runs and checkpoints as the store records them: the lookups the service
makes by Tinker path, and the REST listings (`/training_runs`, their checkpoints, `weights_info`).

Invariants:
- every lookup takes the tenant: another tenant's run or checkpoint is `NotFound`, as one
  that does not exist;
- a Tinker path is `tinker://RUN/weights/NAME` or `tinker://RUN/sampler_weights/NAME`, nothing
  else; a deleted checkpoint's sampler snapshot is forgotten with it (`on_delete`).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Callable

from plexrl.api import errors
from plexrl.api.types import shown
from plexrl.serve.refusals import NotFound
from plexrl.serve.store import KINDS, CheckpointRecord, Run, Store


def parse_tinker_path(path: Any) -> tuple[str, str, str]:
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise errors.InvalidInput(f"path={shown(path)}; expected tinker://RUN/weights/NAME or tinker://RUN/sampler_weights/NAME")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0] or not parts[2]:
        raise errors.InvalidInput(f"path={shown(path)}; expected tinker://RUN/weights/NAME or tinker://RUN/sampler_weights/NAME")
    return parts[0], parts[1], parts[2]


class Runs:
    """Reads of the store for one tenant at a time. `on_delete(tenant, tinker_path)` is told of
    each deleted checkpoint."""

    def __init__(self, store: Store, on_delete: Callable[[str, str], None]):
        self.store = store
        self.on_delete = on_delete

    def checkpoint(self, tenant: str, path: Any) -> CheckpointRecord:
        run_id, kind, name = parse_tinker_path(path)
        record = self.store.checkpoint(tenant, run_id, kind, name)
        if record is None:
            raise NotFound(f"no checkpoint {shown(path)}")
        return record

    def training_run(self, tenant: str, run_id: str) -> dict:
        run = self.store.run(tenant, run_id)
        if run is None:
            raise NotFound(f"no training run {shown(run_id)}")
        return self._run_json(run)

    def _run_json(self, run: Run) -> dict:
        last = self.store.last_checkpoint(run.tenant, run.run_id, "weights")
        last_sampler = self.store.last_checkpoint(run.tenant, run.run_id, "sampler_weights")
        return {"training_run_id": run.run_id, "base_model": run.base_model, "model_owner": run.tenant,
                "is_lora": run.lora_rank > 0, "corrupted": False, "lora_rank": run.lora_rank or None,
                "last_request_time": _iso(run.last_request),
                "last_checkpoint": None if last is None else _checkpoint_json(last),
                "last_sampler_checkpoint": None if last_sampler is None else _checkpoint_json(last_sampler),
                "user_metadata": run.user_metadata}

    def training_runs(self, tenant: str, limit: int, offset: int) -> dict:
        runs, total = self.store.runs(tenant, limit, offset)
        return {"training_runs": [self._run_json(run) for run in runs],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    def checkpoints(self, tenant: str, run_id: str) -> dict:
        if self.store.run(tenant, run_id) is None:
            raise NotFound(f"no training run {shown(run_id)}")
        records = self.store.checkpoints(tenant, run_id)
        return {"checkpoints": [_checkpoint_json(r) for r in records],
                "cursor": {"offset": 0, "limit": len(records), "total_count": len(records)}}

    def delete_checkpoint(self, tenant: str, run_id: str, checkpoint_id: str) -> None:
        kind, _, name = checkpoint_id.partition("/")
        if kind not in KINDS or not name:
            raise NotFound(f"no checkpoint {shown(checkpoint_id)}; expected weights/NAME or sampler_weights/NAME")
        if not self.store.delete_checkpoint(tenant, run_id, kind, name):
            raise NotFound(f"no checkpoint tinker://{run_id}/{checkpoint_id}")
        self.on_delete(tenant, f"tinker://{run_id}/{checkpoint_id}")

    def weights_info(self, tenant: str, tinker_path: Any) -> dict:
        record = self.checkpoint(tenant, tinker_path)
        run = self.store.run(tenant, record.run_id)
        if run is None:
            raise NotFound(f"no training run {record.run_id!r}")
        lora = run.lora_rank > 0
        return {"base_model": run.base_model, "is_lora": lora, "lora_rank": run.lora_rank or None,
                "train_unembed": run.train_unembed if lora else None,
                "train_mlp": run.train_mlp if lora else None,
                "train_attn": run.train_attn if lora else None}


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat()


def _checkpoint_json(record: CheckpointRecord) -> dict:
    return {"checkpoint_id": f"{record.kind}/{record.name}",
            "checkpoint_type": "training" if record.kind == "weights" else "sampler",
            "time": _iso(record.time), "tinker_path": record.tinker_path, "size_bytes": record.size_bytes,
            "public": False, "user_metadata": record.user_metadata}
