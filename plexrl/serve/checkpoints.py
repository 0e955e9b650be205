"""Saving and loading a training model's weights on `plexrl serve`: `save_weights`,
`save_weights_for_sampler` and `load_weights`, each a numbered call of the model
(plexrl/serve/model_calls.py) whose checkpoint the store records.

Invariants:
- a checkpoint's name is checked in the call's turn (a refused save still moves the model's
  sequence on), and its folder is moved into place before its record is written (store.py);
- a checkpoint saved without its optimizer state is never loaded with `optimizer=True`;
- a named save_weights_for_sampler also syncs the weights into a snapshot slot, so a sampler
  created on it right away samples the slot (plexrl/serve/sampling.py);
- a model created from a checkpoint takes the checkpoint's run's base model and LoRA.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Callable

from plexrl.api import errors, validation
from plexrl.api.futures import APIFuture
from plexrl.api.types import LoraConfig
from plexrl.serve.bodies import LoadWeights, SaveForSampler, SaveWeights, user_metadata
from plexrl.serve.futures import Outcome
from plexrl.serve.limits import Limits
from plexrl.serve.model_calls import ModelCalls
from plexrl.serve.models import Model, Models, ModelSetup, model_id
from plexrl.serve.refusals import NotFound
from plexrl.serve.runs import Runs
from plexrl.serve.sampling import Samplers, sync
from plexrl.serve.sessions import Sessions
from plexrl.serve.store import CheckpointRecord, Run, folder_bytes

Extra = Callable[[Model, dict], dict]


class Checkpoints:
    def __init__(self, calls: ModelCalls, models: Models, samplers: Samplers, sessions: Sessions, runs: Runs,
                 limits: Limits, work: concurrent.futures.Executor):
        self.calls = calls
        self.models = models
        self.samplers = samplers
        self.sessions = sessions
        self.runs = runs
        self.store = runs.store
        self.limits = limits
        self.work = work

    def save_weights(self, tenant: str, body: SaveWeights) -> str:
        return self._save(tenant, body, "weights", with_optimizer=True)

    def _save(self, tenant: str, body: SaveWeights, kind: str, with_optimizer: bool, extra: Extra | None = None) -> str:
        name, most = body.name, self.limits.metadata_bytes

        def call(model: Model) -> APIFuture:
            validation.check_checkpoint_name(name)
            user_metadata(body.user_metadata, most)
            return model.client.save_state(f"serve-{kind}-{name}", with_optimizer=with_optimizer)

        def finish(model: Model, response) -> Outcome:
            folder = self.store.folder_for(tenant, model.run.run_id, kind, name)
            written = Path(response.path)
            record = CheckpointRecord(model.run.run_id, kind, name, tenant, str(folder), time.time(),
                                      folder_bytes(written), with_optimizer, user_metadata(body.user_metadata, most))
            self.store.add_checkpoint(record, written, body.overwrite)
            answer = {"path": record.tinker_path}
            if extra is not None:
                answer = extra(model, answer)
            return Outcome(json=answer)

        return self.calls.submit(tenant, body.model_id, body.seq_id, f"save_{kind}", call, finish)

    def save_weights_for_sampler(self, tenant: str, body: SaveForSampler) -> str:
        model = self.models.owned(tenant, body.model_id)
        if body.named is not None:
            def remember(model: Model, answer: dict) -> dict:
                self.samplers.remember(tenant, answer["path"], model, sync(model))
                return answer

            return self._save(tenant, body.named, "sampler_weights", with_optimizer=False, extra=remember)

        session = self.sessions.live(tenant, model.session_id)
        sampler_seq = body.sampling_session_seq_id

        def call(model: Model) -> APIFuture:
            return _as_api(self.work.submit(sync, model))

        def finish(model: Model, synced) -> Outcome:
            sampler = self.samplers.from_sync(session, sampler_seq, model, synced)
            return Outcome(json={"type": "save_weights_for_sampler", "sampling_session_id": sampler.sampler_id})

        return self.calls.submit(tenant, model.model_id, body.seq_id, "save_weights_for_sampler", call, finish)

    def load_weights(self, tenant: str, body: LoadWeights) -> str:
        if body.model_id is not None:
            return self._load_into(tenant, body)
        session = self.sessions.live(tenant, body.session_id)
        record = self._loadable(tenant, body)
        source = self.store.run(tenant, record.run_id)
        if source is None:
            raise NotFound(f"no training run {record.run_id!r} for checkpoint {body.path}")
        lora = LoraConfig(rank=source.lora_rank, train_mlp=source.train_mlp, train_attn=source.train_attn,
                          train_unembed=source.train_unembed) if source.lora_rank else None
        run = Run(model_id(session, body.model_seq_id), tenant, source.base_model, source.lora_rank, source.train_mlp,
                  source.train_attn, source.train_unembed, user_metadata=body.user_metadata or source.user_metadata)
        return self.models.enqueue(session, body.model_seq_id, run, ModelSetup(lora, record, body.with_optimizer))

    def _load_into(self, tenant: str, body: LoadWeights) -> str:
        def call(model: Model) -> APIFuture:
            record = self._loadable(tenant, body)
            load = model.client.load_state_with_optimizer if body.with_optimizer else model.client.load_state
            return load(record.folder)

        return self.calls.submit(tenant, body.model_id, body.seq_id, "load_weights", call,
                                 lambda model, _: Outcome(json={"type": "load_weights", "path": body.path}))

    def _loadable(self, tenant: str, body: LoadWeights) -> CheckpointRecord:
        record = self.runs.checkpoint(tenant, body.path)
        if body.with_optimizer and not record.with_optimizer:
            raise errors.InvalidInput(f"checkpoint {body.path} was saved without its optimizer state "
                                      "(save_weights_for_sampler); load it with optimizer=False")
        return record


def _as_api(inner: concurrent.futures.Future) -> APIFuture:
    """A service-thread future as an APIFuture (for a call that is several runtime calls)."""
    api = APIFuture()
    inner.add_done_callback(lambda f: api.set_exception(f.exception()) if f.exception() else api.set_result(f.result()))
    return api
