"""Calls on a training model (forward, forward_backward, optim_step, and the save and load calls
of plexrl/serve/checkpoints.py): each becomes one call of the job-side API
(plexrl/api/client.py), so it is checked and scheduled exactly as a local job's call is.

Invariants:
- calls on one model reach the runtime in `seq_id` order (the SDK numbers them and sends
  chunks of one forward_backward in parallel): a call waits in the model's `Sequencer` for the
  ones numbered before it, for at most `gap_s`;
- what a numbered call checks, it checks in its turn (inside its `call`): a refused call still
  moves its model's sequence on;
- a call's outcome is made on the runtime thread that delivered its result only when making it
  merely encodes (`inline`); one that moves files or waits runs on a service thread;
- a session's optim_step is its job's step boundary (`report_step`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass
from typing import Any, Callable

from plexrl.api import errors
from plexrl.api.futures import APIFuture
from plexrl.serve import wire
from plexrl.serve.bodies import OptimStep
from plexrl.serve.futures import Outcome, RequestTable, resolve
from plexrl.serve.models import Model, Models
from plexrl.serve.sessions import Sessions
from plexrl.serve.store import Store

log = logging.getLogger("plexrl.serve")

Call = Callable[[Model], APIFuture]
Finish = Callable[[Model, Any], Outcome]


@dataclass
class Turn:
    """One call of a model from its turn in the model's sequence to its outcome in `future`."""

    model: Model
    call: Call
    finish: Finish
    inline: bool
    future: concurrent.futures.Future
    work: concurrent.futures.Executor
    submitted: bool = False  # reached the runtime

    def go(self) -> None:
        model = self.model
        if model.failed is not None:
            resolve(self.future, Outcome.failed(errors.InvalidInput(
                f"model {model.model_id!r} could not be created: {model.failed}")))
            return
        self.submitted = True
        try:
            api_future = self.call(model)
        except Exception as exc:
            resolve(self.future, Outcome.failed(exc))
            return
        if self.inline:
            api_future.add_done_callback(self.finished)
        else:
            api_future.add_done_callback(lambda done: self.work.submit(self.finished, done))

    def finished(self, done: APIFuture) -> None:
        try:
            outcome = self.finish(self.model, done.result())
        except Exception as exc:
            outcome = Outcome.failed(exc)
        resolve(self.future, outcome)


class ModelCalls:
    """Submits calls on training models in their sequence, and says where a queued one waits."""

    def __init__(self, cluster, store: Store, models: Models, sessions: Sessions, requests: RequestTable,
                 clock: Callable[[], float], work: concurrent.futures.Executor):
        self.cluster = cluster
        self.store = store
        self.models = models
        self.sessions = sessions
        self.requests = requests
        self.clock = clock
        self.work = work

    def submit(self, tenant: str, model_id: Any, seq: int | None, kind: str, call: Call, finish: Finish,
               inline: bool = False, nbytes: int = 0) -> str:
        """A call on a training model, run in seq order: `call(model)` submits it to the runtime
        and `finish(model, result)` makes its outcome (see `Turn`)."""
        model = self.models.owned(tenant, model_id)
        session = self.sessions.live(tenant, model.session_id)

        def start(future):
            turn = Turn(model, call, finish, inline, future, self.work)
            model.sequencer.arrive(seq, turn.go)
            return lambda: model.sequencer.waiting_for(seq) or self._runtime_state(model, turn.submitted)

        key = (kind, model.model_id, seq) if seq is not None else None
        if not self.requests.known(tenant, key):
            model.sequencer.check(seq)
        self._touch(model)
        request_id, _ = self.requests.enqueue(tenant, session.session_id, key, start, nbytes=nbytes,
                                              unblocks=seq is not None and seq == model.sequencer.next_seq)
        return request_id

    def _touch(self, model: Model) -> None:
        """The run's last request time, written at most once a second a model, off the caller's thread."""
        now = self.clock()
        if now - model.last_touch < 1.0:
            return
        model.last_touch = now
        self.work.submit(self._write_touch, model.run.run_id)

    def _write_touch(self, run_id: str) -> None:
        try:
            self.store.touch_run(run_id)
        except Exception as exc:  # a busy database must not fail a call; the next touch catches up
            log.warning("recording the last request of %s: %s", run_id, exc)

    def _runtime_state(self, model: Model, submitted: bool) -> str:
        if not submitted:
            return "queued"
        try:
            where = self.cluster.residency().get(model.client.state.state_id, "")
        except Exception:
            where = ""
        if where.startswith("device"):
            return f"queued or running on {where} (requests of other jobs may run first)"
        if where:
            return f"waiting for its state to be switched in (now on {where})"
        return "queued in the runtime"

    def forward_backward(self, tenant: str, request: wire.ForwardBackwardCall, nbytes: int,
                         forward_only: bool | None = None) -> str:
        """/forward_backward (or /forward: `forward_only`) of a decoded protobuf body of `nbytes`."""
        only = request.forward_only if forward_only is None else forward_only

        def call(model: Model) -> APIFuture:
            run = model.client.forward if only else model.client.forward_backward
            return run(request.data, request.loss_fn, request.loss_fn_config or None)

        def finish(model: Model, output) -> Outcome:
            output = type(output)(output.loss_fn_outputs, wire.tinker_metrics(output.metrics))
            return Outcome(proto=wire.encode_forward_backward_output(output))

        return self.submit(tenant, request.model_id, request.seq_id, "forward_backward", call, finish, inline=True,
                           nbytes=nbytes)

    def optim_step(self, tenant: str, body: OptimStep) -> str:
        def call(model: Model) -> APIFuture:
            return model.client.optim_step(wire.adam_params(body.adam_params))

        def finish(model: Model, response) -> Outcome:
            self.work.submit(self._step_mark, model)
            return Outcome(json={"type": "optim_step", "metrics": wire.tinker_metrics(response.metrics)})

        return self.submit(tenant, body.model_id, body.seq_id, "optim_step", call, finish, inline=True)

    def _step_mark(self, model: Model) -> None:
        """A session's optim_step is its job's step boundary (profiling, checkpoints, re-placement)."""
        session = self.sessions.get(model.session_id)
        if session is None or session.finished:
            return
        session.steps += 1
        try:
            session.client.report_step(session.steps)
        except Exception as exc:
            log.warning("step mark of %s: %s: %s", session.job, type(exc).__name__, exc)
