"""The HTTP face of `plexrl serve`: the Tinker SDK 0.38.0 protocol (see ../shared/TINKER.md) over
FastAPI, on a `Service` (plexrl/serve/service.py) that holds the state.

Answers, as the SDK expects them:
- a POST of a request that takes time (create_model, forward_backward, optim_step, save/load
  weights, asample) only enqueues it and answers `{request_id}` at once; `retrieve_future`
  holds a poll up to `poll_hold_s`, then answers `try_again` with a queue state and a reason
  saying what the request waits for;
- results the SDK reads as protobuf (ForwardBackwardOutput, SampleResponse) go as
  `application/x-protobuf`, the rest as JSON; a request's failure is `{error, category}` with
  category `user` for bad input (the runtime's own message) and `server` otherwise;
- HTTP errors always carry a JSON body naming the problem (the SDK takes an empty 4xx for a
  proxy's and retries it): 400 malformed JSON or protobuf, 401 missing or unknown key, 404
  anything that is not the caller's (or an endpoint PlexRL does not serve, named), 410 a
  finished session, 413 a body over `max_body_bytes`, 429 past a tenant's limits. Bad input
  never gets a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from plexrl.api import errors
from plexrl.serve import wire
from plexrl.serve.service import BadRequest, Outcome, ServeError, Service, TooMany

log = logging.getLogger("plexrl.serve")

PROTOBUF = "application/x-protobuf"
MAX_BODY_BYTES = 64 << 20


class BodyTooLarge(ServeError):
    status = 413


def create_app(service: Service, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="PlexRL (Tinker-compatible)", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.exception_handler(ServeError)
    async def serve_error(request: Request, exc: ServeError):
        return _error(exc.status, exc.message)

    @app.exception_handler(errors.InvalidInput)
    async def invalid_input(request: Request, exc: errors.InvalidInput):
        return _error(400, str(exc))

    @app.exception_handler(wire.WireError)
    async def wire_error(request: Request, exc: wire.WireError):
        return _error(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return _error(404, f"{request.method} {request.url.path} is not an endpoint PlexRL serves "
                               "(it speaks the Tinker SDK's core protocol: see README)")
        if exc.status_code == 405:
            return _error(405, f"{request.method} is not allowed on {request.url.path}")
        return _error(exc.status_code, str(exc.detail) or "error")

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return _error(500, f"internal server error: {type(exc).__name__}: {exc}")

    async def body_bytes(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise BodyTooLarge(f"request body of {int(declared):,} bytes; expected at most {max_body_bytes:,}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise BodyTooLarge(f"request body over {max_body_bytes:,} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def body_json(request: Request) -> dict:
        raw = await body_bytes(request)
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"request body is not valid JSON ({exc}); expected a JSON object") from None
        if not isinstance(body, dict):
            raise BadRequest(f"request body is a JSON {type(body).__name__}; expected a JSON object")
        return body

    def tenant(request: Request) -> str:
        return service.tenant(request.headers.get("x-api-key"))

    def future_answer(request_id: str, **extra) -> dict:
        return {"request_id": request_id, **extra}

    async def enqueue(request: Request, submit) -> dict:
        """A future-type POST: bad input the service refuses at once becomes a failed request
        (RequestFailedError, category user, in the SDK) rather than an HTTP error, so the
        caller's client stays usable; malformed bodies are 400 before this."""
        who = tenant(request)
        body = await body_json(request)
        return future_answer(accepted(who, submit, body))

    def accepted(who: str, submit, body) -> str:
        try:
            return submit(who, body)
        except errors.InvalidInput as exc:
            return service.failed(who, exc)

    # -- start-up, sessions -----------------------------------------------------------------------
    @app.post("/api/v1/client/config")
    async def client_config(request: Request):
        tenant(request)
        await body_json(request)
        return service.client_flags  # {}: the SDK's defaults (API-key auth, client-side custom losses, per-request polls)

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request):
        tenant(request)
        return service.capabilities()

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        who = tenant(request)
        body = await body_json(request)
        return await asyncio.to_thread(service.create_session, who, body)

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        return service.heartbeat(tenant(request), await body_json(request))

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        who = tenant(request)
        await body_bytes(request)
        return await asyncio.to_thread(service.finish_session, who, session_id)

    # -- models -----------------------------------------------------------------------------------
    app.add_api_route("/api/v1/create_model", _future_route(enqueue, service.create_model), methods=["POST"])

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        return service.get_info(tenant(request), await body_json(request))

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        who = tenant(request)
        return future_answer(accepted(who, service.forward_backward, await proto_body(request)))

    @app.post("/api/v1/forward")
    async def forward(request: Request):
        who = tenant(request)
        return future_answer(accepted(who, service.forward, await proto_body(request)))

    async def proto_body(request: Request) -> bytes:
        raw = await body_bytes(request)
        kind = request.headers.get("content-type", "")
        if "json" in kind:
            raise BadRequest("forward_backward takes a protobuf ForwardBackwardRequest "
                             f"(Content-Type {PROTOBUF}), as the Tinker SDK 0.38 sends it; got {kind}")
        return raw

    # JSON requests that become futures: each POST enqueues its request and answers its id
    for name, submit in (("optim_step", service.optim_step), ("save_weights", service.save_weights),
                         ("load_weights", service.load_weights),
                         ("save_weights_for_sampler", service.save_weights_for_sampler)):
        app.add_api_route(f"/api/v1/{name}", _future_route(enqueue, submit), methods=["POST"], name=name)

    # -- sampling ---------------------------------------------------------------------------------
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        who = tenant(request)
        answer = service.create_sampling_session(who, await body_json(request))
        return await asyncio.wrap_future(answer)

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler(sampler_id: str, request: Request):
        return service.sampler_info(tenant(request), sampler_id)

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        who = tenant(request)
        body = await body_json(request)
        try:
            return service.sample(who, body)
        except errors.InvalidInput as exc:
            return {"request_id": service.failed(who, exc), "sample_sequence_ids": []}

    # -- futures ----------------------------------------------------------------------------------
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        who = tenant(request)
        body = await body_json(request)
        pending = service.future(who, body.get("request_id"))
        waiter = asyncio.wrap_future(pending.future)
        done, _ = await asyncio.wait({waiter}, timeout=service.limits.poll_hold_s)
        if not done:
            reason = pending.waiting_for()
            state = "paused_capacity" if "room on the cluster" in reason else "active"
            return {"type": "try_again", "request_id": pending.request_id, "queue_state": state,
                    "queue_state_reason": reason}
        outcome: Outcome = waiter.result()
        service.retrieved(pending)
        if outcome.proto is not None:
            return Response(outcome.proto, media_type=PROTOBUF)
        if outcome.error is not None:
            return {"error": outcome.error, "category": outcome.category}
        return outcome.json

    # -- runs and checkpoints ---------------------------------------------------------------------
    @app.get("/api/v1/training_runs")
    async def training_runs(request: Request, limit: int = 20, offset: int = 0):
        if limit < 0 or offset < 0:
            raise BadRequest(f"limit={limit}, offset={offset}; expected integers >= 0")
        return service.training_runs(tenant(request), min(limit, 1000), offset)

    @app.get("/api/v1/training_runs/{run_id}")
    async def training_run(run_id: str, request: Request):
        return service.training_run(tenant(request), run_id)

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def checkpoints(run_id: str, request: Request):
        return service.checkpoints(tenant(request), run_id)

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request):
        await asyncio.to_thread(service.delete_checkpoint, tenant(request), run_id, checkpoint_id)
        return Response(status_code=204)

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request):
        return service.weights_info(tenant(request), await body_json(request))

    return app


def _future_route(enqueue, submit):
    async def route(request: Request):
        return await enqueue(request, submit)

    return route


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message, "error": message}, status_code=status)


__all__ = ["create_app", "TooMany"]
