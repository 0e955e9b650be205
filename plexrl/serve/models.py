"""Training models on `plexrl serve`: a Tinker training client is a trainable model state of its
session's job (LoRA through peft, or full parameters for `rank=0`).

Invariants:
- creating a model only enqueues it: placing it (waiting for admission) and loading a
  checkpoint into it run on the service's threads, and its calls wait in its `Sequencer` until
  it is placed;
- a model's id is `SESSION:train:SEQ`, one per (session, model_seq_id): a second creation under
  the same number is refused;
- a model whose placement failed fails every call with that reason;
- a model of another tenant is `NotFound`, as one that does not exist.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Callable

from plexrl.api import errors
from plexrl.api.client import TrainingClient
from plexrl.api.types import LoraConfig
from plexrl.serve.bodies import CreateModel
from plexrl.serve.catalog import Catalog
from plexrl.serve.futures import Outcome, RequestTable, resolve
from plexrl.serve.limits import Limits
from plexrl.serve.refusals import Gone, owned
from plexrl.serve.sequencer import Sequencer
from plexrl.serve.sessions import Session, Sessions
from plexrl.serve.store import CheckpointRecord, Run, Store


@dataclass
class Model:
    model_id: str
    tenant: str
    session_id: str
    run: Run
    sequencer: Sequencer
    client: TrainingClient | None = None  # set once placed
    syncs: int = 0  # sampler snapshots made
    last_touch: float = float("-inf")  # when its run's last request time was last written
    failed: BaseException | None = None  # placing it failed: every call fails with this


@dataclass(frozen=True)
class ModelSetup:
    """What placing a new model takes: its LoRA (None: full parameters) and, for a model created
    from a checkpoint, the checkpoint and whether its optimizer state is loaded too."""

    lora: LoraConfig | None
    checkpoint: CheckpointRecord | None = None
    with_optimizer: bool = False


class Models:
    """The training models this server holds, by id, and their creation."""

    def __init__(self, store: Store, catalog: Catalog, sessions: Sessions, requests: RequestTable, limits: Limits,
                 clock: Callable[[], float], lock: threading.RLock, work: concurrent.futures.Executor):
        self.store = store
        self.catalog = catalog
        self.sessions = sessions
        self.requests = requests
        self.limits = limits
        self.clock = clock
        self.lock = lock
        self.work = work
        self.by_id: dict[str, Model] = {}

    def owned(self, tenant: str, model_id) -> Model:
        return owned(self.by_id, tenant, model_id, "model")

    def create(self, tenant: str, body: CreateModel) -> str:
        session = self.sessions.live(tenant, body.session_id)
        self.catalog.folder(body.base_model)
        lora = body.lora
        run = Run(model_id(session, body.model_seq_id), tenant, body.base_model, lora.rank if lora else 0,
                  *_lora_flags(lora), user_metadata=body.user_metadata)
        return self.enqueue(session, body.model_seq_id, run, ModelSetup(lora))

    def enqueue(self, session: Session, seq: int, run: Run, placement: ModelSetup) -> str:
        """The request that creates model `seq` of `session` (from a checkpoint when the placement
        names one): its id, the same for a retried submission."""
        kind, waiting = (("create_model", "the model is placed") if placement.checkpoint is None
                         else ("load_weights_create", "loading the checkpoint"))

        def start(future):
            model = self._new(session, seq, run)
            self.work.submit(self._place, model, placement, future)
            return lambda: model.sequencer.waiting_for(None) or waiting

        request_id, _ = self.requests.enqueue(session.tenant, session.session_id, (kind, session.session_id, seq),
                                              start)
        return request_id

    def _new(self, session: Session, seq: int, run: Run) -> Model:
        model = Model(run.run_id, session.tenant, session.session_id, run,
                      Sequencer(1, self.limits.gap_s, self.clock, self.limits.seq_window))
        with self.lock:
            if run.run_id in self.by_id:
                raise errors.InvalidInput(f"model_seq_id={seq} is already a model of session {session.session_id!r}")
            self.by_id[run.run_id] = model
            session.models[seq] = run.run_id
        return model

    def _place(self, model: Model, placement: ModelSetup, future: concurrent.futures.Future) -> None:
        """On a service thread: add the model to the cluster (waiting for admission), load a
        checkpoint into it if asked, record its run, then let its queued calls go."""
        try:
            self._load(model, placement)
            self.store.add_run(model.run)
            if placement.checkpoint is None:
                outcome = Outcome(json={"model_id": model.model_id, "type": "create_model"})
            else:
                outcome = Outcome(json={"path": placement.checkpoint.tinker_path, "type": "load_weights"})
        except Exception as exc:
            model.failed = exc
            outcome = Outcome.failed(exc)
        model.sequencer.open()
        resolve(future, outcome)

    def _load(self, model: Model, placement: ModelSetup) -> None:
        session = self.sessions.get(model.session_id)
        if session is None or session.finished:
            raise Gone(f"session {model.session_id!r} finished while its model was being placed")
        folder = self.catalog.folder(model.run.base_model)
        name = model.model_id.split(":", 1)[1]  # "train:N"
        lora = placement.lora
        seed = lora.seed if lora else 0
        if lora is not None:
            model.client = session.client.create_lora_training_client(
                folder, lora.rank, seed=seed, name=name, train_mlp=lora.train_mlp, train_attn=lora.train_attn,
                train_unembed=lora.train_unembed)
        else:
            model.client = session.client.create_training_client(folder, seed=seed, name=name)
        if placement.checkpoint is not None:
            client = model.client
            load = client.load_state_with_optimizer if placement.with_optimizer else client.load_state
            load(placement.checkpoint.folder).result()

    def get_info(self, tenant: str, model_id) -> dict:
        model = self.owned(tenant, model_id)
        run = model.run
        return {"type": "get_info", "model_id": model.model_id, "model_name": run.base_model,
                "model_data": self.catalog.model_data(run.base_model),
                "is_lora": run.lora_rank > 0, "lora_rank": run.lora_rank or None}

    def forget(self, model_ids: list[str]) -> None:
        """Drop a finished session's models (call with the lock held)."""
        for model_id in model_ids:
            self.by_id.pop(model_id, None)

    def drain(self) -> None:
        """Let every model skip a seq_id gap that outlived gap_s."""
        with self.lock:
            models = list(self.by_id.values())
        for model in models:
            model.sequencer.drain()


def model_id(session: Session, seq: int) -> str:
    return f"{session.session_id}:train:{seq}"


def _lora_flags(lora: LoraConfig | None) -> tuple[bool, bool, bool]:
    if lora is None:
        return True, True, True
    return lora.train_mlp, lora.train_attn, lora.train_unembed
