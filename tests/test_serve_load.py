"""`plexrl serve` under load and across stops: tenants training at once, twice in a row on one
server, every call completing and nothing left behind; a server killed with SIGKILL mid-training,
and a restarted server listing every run and checkpoint and resuming bitwise, then stopped with
SIGTERM mid-call; clients in flight erring or finishing, never hanging. The timed figures of the
same load are `plexrl bench serve --tenants N` (plexrl/bench/serve_load.py); here only what must
hold."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from plexrl.bench import serve_load  # noqa: E402
from plexrl.engines.local import LocalCluster  # noqa: E402
from plexrl.serve.limits import Limits  # noqa: E402
from plexrl.serve.service import TinkerService  # noqa: E402
from plexrl.serve.store import Store  # noqa: E402
from tests.serve_helpers import T, served, tenants  # noqa: E402

pytestmark = pytest.mark.slow


def tables(service: TinkerService) -> dict[str, int]:
    """What the service holds per request, session and model: flat once sessions are done."""
    with service._lock:
        return {"pending": len(service.pending), "keys": len(service.requests.keys), "sessions": len(service.sessions),
                "models": len(service.models.by_id), "samplers": len(service.samplers.by_id),
                "snapshots": len(service.samplers.snapshots), "queued": sum(service.requests.queued.values()),
                "kept": sum(service.requests.kept.values())}


def test_four_tenants_train_at_once_twice_and_leave_nothing_behind(tmp_path, micro_model):
    keys = serve_load.keys_for(4)
    with LocalCluster(devices=2, checkpoint_dir=str(tmp_path / "scratch")) as cluster:
        service = TinkerService(cluster, Store(tmp_path / "state"), {"micro": micro_model}, tenants(tmp_path, **keys),
                          Limits(poll_hold_s=1.0, retention_s=0.5))
        with served(service) as server:
            after = []
            for _ in range(2):
                latencies, made = serve_load.train_all(server.url, list(keys.values()), "micro", clients=2, steps=2,
                                                       budget_s=300)
                assert made == 4 * 2 * 2 * len(serve_load.CALLS)  # every call of every client completed
                assert {call: len(v) for call, v in latencies.by_call.items()} == {c: 16 for c in serve_load.CALLS}
                deadline = time.monotonic() + 30  # the reaper drops what the finished sessions left
                while tables(service)["sessions"] and time.monotonic() < deadline:
                    time.sleep(0.2)
                after.append(tables(service))
            assert after[0] == after[1] == dict.fromkeys(after[0], 0), after


def test_sigkill_then_sigterm_mid_training_a_restart_lists_everything_and_resumes_bitwise(tmp_path, micro_model):
    ids = [5, 6, 7, 8, 9, 10]
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    key = "tml-restart-0123456789abcdef"

    def steps(training, n):
        for _ in range(n):
            training.forward_backward([datum], "cross_entropy").result(T)
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result(T)
        out = training.forward([datum], "cross_entropy").result(T)
        return np.asarray(out.loss_fn_outputs[0]["logprobs"].data, dtype=np.float32)

    def in_flight_then(server, sig, training) -> None:
        """A call submitted, the server signalled at once: the call ends (done or failed) by its deadline."""
        future = training.forward_backward([datum], "cross_entropy")
        outcome: list = []
        waiter = threading.Thread(target=lambda: outcome.append(_settle(future, 20)), daemon=True)
        waiter.start()
        status = server.stop(sig)
        waiter.join(60)
        assert outcome, "a client's call still waits 60 s after the server stopped"
        assert status == (0 if sig == signal.SIGTERM else -signal.SIGKILL), server.log.read_text()[-2000:]

    state = tmp_path / "state"
    models = {"micro": micro_model}
    with running(state, models) as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=key)
        training = client.create_lora_training_client("micro", rank=0, seed=3,
                                                      user_metadata={"renderer_name": "role_colon"}).result(T)
        run_id = training.model_id
        steps(training, 2)
        checkpoint = training.save_state("resume-here").result(T).path
        uninterrupted = steps(training, 2)
        in_flight_then(server, signal.SIGKILL, training)  # no chance to finish anything

    with running(state, models) as server:
        rest = tinker.RestClient(base_url=server.url, api_key=key)
        run = rest.get_training_run(run_id).result(T)
        assert run.user_metadata == {"renderer_name": "role_colon"} and run.last_checkpoint.tinker_path == checkpoint
        assert run_id in {r.training_run_id for r in rest.list_training_runs().result(T).training_runs}
        assert [c.tinker_path for c in rest.list_checkpoints(run_id).result(T).checkpoints] == [checkpoint]
        client = tinker.ServiceClient(base_url=server.url, api_key=key)
        resumed = client.create_training_client_from_state_with_optimizer(checkpoint).result(T)
        assert resumed.model_id.split(":")[0] != run_id.split(":")[0]  # a new session's id is never an old one's
        assert np.array_equal(steps(resumed, 2), uninterrupted)
        in_flight_then(server, signal.SIGTERM, resumed)  # a graceful stop: exit 0 (a restart after one: test_serve)


@contextlib.contextmanager
def running(state, models):
    """`plexrl serve` in a process of its own on `state`; killed at the end if still running."""
    server = serve_load.start_server(state, models)
    try:
        yield server
    finally:
        server.stop(signal.SIGKILL)


def _settle(future, timeout_s: float) -> str:
    try:
        future.result(timeout_s)
        return "done"
    except Exception as exc:  # the server went away: any error, as long as it comes
        return type(exc).__name__
