"""What the tests of `plexrl serve` share: an in-process server on a local cluster, and the
protocol's two steps spoken with bare httpx (a POST that answers a request id, then polls of
retrieve_future until the result). Every loop is bounded in count."""

from __future__ import annotations

import contextlib
import os

import httpx

os.environ.setdefault("TINKER_TELEMETRY", "0")

from plexrl.serve.app import create_app  # noqa: E402
from plexrl.serve.server import Server  # noqa: E402
from plexrl.serve.tenants import Tenants  # noqa: E402

T = 120  # seconds any one result may take


def tenants(folder, **keys: str) -> Tenants:
    """Tenants from a key file written in `folder`: one `TENANT KEY` line per keyword."""
    path = folder / "keys.txt"
    path.write_text("# tenants\n" + "".join(f"{tenant} {key}\n" for tenant, key in keys.items()))
    return Tenants.from_file(path)


def session(h: httpx.Client, **fields) -> str:
    answer = h.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0",
                                                    **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()["session_id"]


def result(h: httpx.Client, request_id: str, polls: int = 60) -> httpx.Response:
    """The request's answer once it is not try-again (at most `polls` polls)."""
    for _ in range(polls):
        answer = h.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if answer.headers.get("content-type", "").startswith("application/json") and \
                answer.json().get("type") == "try_again":
            assert answer.json()["queue_state_reason"]
            continue
        return answer
    raise AssertionError(f"request {request_id} did not finish in {polls} polls")


def create_model(h: httpx.Client, session_id: str, base_model: str, seq: int = 0, rank: int = 0) -> str:
    created = h.post("/api/v1/create_model", json={"session_id": session_id, "model_seq_id": seq,
                                                   "base_model": base_model, "lora_config": {"rank": rank}})
    assert created.status_code == 200, created.text
    return result(h, created.json()["request_id"]).json()["model_id"]


@contextlib.contextmanager
def served(service):
    """`service` on a free loopback port; the server and the service closed after."""
    try:
        with Server(create_app(service)) as server:
            yield server
    finally:
        service.close()
