"""The HTTP face of `plexrl serve`: the Tinker SDK 0.38.0 protocol (see ../shared/TINKER.md) over
FastAPI, on a `Service` (plexrl/serve/service.py) that holds the state.

Answers, as the SDK expects them:
- a POST of a request that takes time (create_model, forward_backward, optim_step, save/load
  weights, asample) only enqueues it and answers `{request_id}` at once; `retrieve_future`
  holds a poll up to `poll_hold_s`, then answers `try_again` with a queue state and a reason
  saying what the request waits for and since when;
- results the SDK reads as protobuf (ForwardBackwardOutput, SampleResponse) go as
  `application/x-protobuf`, the rest as JSON; a request's failure is `{error, category}` with
  category `user` for bad input (the runtime's own message) and `server` otherwise;
- HTTP errors always carry a JSON body naming the problem (the SDK takes an empty 4xx for a
  proxy's and retries it): 400 malformed or out-of-bounds input, 401 missing or unknown key, 404
  anything that is not the caller's (or an endpoint PlexRL does not serve, named), 410 a finished
  session, 413 a body or a value over its limit, 429 past a tenant's limits. Bad input never gets
  a 5xx; a bug does, as a 500 whose body names an incident (the log has its traceback) and
  nothing else.

Where the work runs (plexrl/serve/edge.py): the event loop reads bodies (bounded before they are
read whole) and resolves tenants; parsing, decoding and the service's handling run on the edge's
`TenantPool`, at most a share of it per tenant. Only `retrieve_future` and the heartbeat, whose
bodies are a few dozen bytes, are parsed on the loop, and only when under `INLINE_BYTES`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from plexrl.api import errors
from plexrl.serve import wire
from plexrl.serve.edge import EdgeError, EdgeLimits, TenantPool, parse_json
from plexrl.serve.service import BadRequest, Outcome, ServeError, Service, TooMany

log = logging.getLogger("plexrl.serve")

PROTOBUF = "application/x-protobuf"
INLINE_BYTES = 1024  # a poll's or a heartbeat's body this small is parsed on the loop (bounded like a header)
MAX_OFFSET = (1 << 31) - 1  # listing offsets and limits past it are refused


class JSON(JSONResponse):
    """JSON answers in ASCII: a value that is not valid Unicode (a lone surrogate in an old record)
    goes out escaped instead of failing the answer."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=True, separators=(",", ":")).encode("ascii")


def create_app(service: Service) -> FastAPI:
    # redirect_slashes off: a path whose id is "/" (training_runs/%2F) would get a 307 with an empty
    # body, which the SDK takes for a proxy's answer; it gets a 404 that names it instead
    app = FastAPI(title="PlexRL (Tinker-compatible)", docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=JSON, redirect_slashes=False)
    app.state.service = service
    limits: EdgeLimits = service.edge
    pool = TenantPool(limits.workers, limits.tenant_share, limits.tenant_cpu)
    service.on_close(pool.close)

    @app.exception_handler(ServeError)
    async def serve_error(request: Request, exc: ServeError):
        return _error(exc.status, exc.message)

    @app.exception_handler(EdgeError)
    async def edge_error(request: Request, exc: EdgeError):
        return _error(exc.status, exc.message)

    @app.exception_handler(errors.InvalidInput)
    async def invalid_input(request: Request, exc: errors.InvalidInput):
        return _error(400, _bounded(str(exc)))

    @app.exception_handler(wire.WireError)
    async def wire_error(request: Request, exc: wire.WireError):
        return _error(400, _bounded(str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return _error(404, f"{request.method} {_bounded(request.url.path, 200)} is not an endpoint PlexRL serves "
                               "(it speaks the Tinker SDK's core protocol: see README)")
        if exc.status_code == 405:
            return _error(405, f"{request.method} is not allowed on {_bounded(request.url.path, 200)}")
        return _error(exc.status_code, _bounded(str(exc.detail)) or "error")

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        incident = secrets.token_hex(6)
        log.error("internal error %s on %s %s", incident, request.method, request.url.path, exc_info=exc)
        return _error(500, f"internal server error (incident {incident}; the server's log has the details)")

    async def body_bytes(request: Request, limit: int) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise EdgeError(f"request body of {int(declared):,} bytes; expected at most {limit:,}", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise EdgeError(f"request body over {limit:,} bytes; expected at most {limit:,}", 413)
            chunks.append(chunk)
        return b"".join(chunks)

    def tenant(request: Request) -> str:
        return service.tenant(request.headers.get("x-api-key"))

    async def handled(request: Request, handle: Callable[[str, dict], Any]) -> Any:
        """A JSON request parsed and handled on the tenant's share of the pool."""
        who = tenant(request)
        raw = await body_bytes(request, limits.max_json_bytes)
        return await pool.run(who, lambda: handle(who, parse_json(raw, limits)))

    async def small_json(request: Request) -> tuple[str, dict]:
        """A body that is a few dozen bytes when well-formed: parsed on the loop when it is small."""
        who = tenant(request)
        raw = await body_bytes(request, limits.max_json_bytes)
        if len(raw) <= INLINE_BYTES:
            return who, parse_json(raw, limits)
        return who, await pool.run(who, parse_json, raw, limits)

    def accepted(who: str, submit, body) -> dict:
        """A future-type POST: bad input the service refuses at once becomes a failed request
        (RequestFailedError, category user, in the SDK) rather than an HTTP error, so the
        caller's client stays usable; malformed bodies are 4xx before this."""
        try:
            return {"request_id": submit(who, body)}
        except errors.InvalidInput as exc:
            return {"request_id": service.failed(who, exc)}

    def future_route(submit):
        async def route(request: Request):
            return await handled(request, lambda who, body: accepted(who, submit, body))

        return route

    # -- start-up, sessions -----------------------------------------------------------------------
    @app.post("/api/v1/client/config")
    async def client_config(request: Request):
        await handled(request, lambda who, body: None)
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
        return await handled(request, service.create_session)

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        return service.heartbeat(*await small_json(request))

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        who = tenant(request)
        await body_bytes(request, limits.max_json_bytes)
        return await pool.run(who, service.finish_session, who, session_id)

    # -- models -----------------------------------------------------------------------------------
    app.add_api_route("/api/v1/create_model", future_route(service.create_model), methods=["POST"])

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        return await handled(request, service.get_info)

    async def protobuf_call(request: Request, submit) -> dict:
        who = tenant(request)
        kind = request.headers.get("content-type", "")
        if "json" in kind:
            raise BadRequest(f"{request.url.path.rsplit('/', 1)[-1]} takes a protobuf ForwardBackwardRequest "
                             f"(Content-Type {PROTOBUF}), as the Tinker SDK 0.38 sends it; got {_bounded(kind, 100)}")
        raw = await body_bytes(request, limits.max_body_bytes)
        return await pool.run(who, accepted, who, submit, raw)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        return await protobuf_call(request, service.forward_backward)

    @app.post("/api/v1/forward")
    async def forward(request: Request):
        return await protobuf_call(request, service.forward)

    # JSON requests that become futures: each POST enqueues its request and answers its id
    for name, submit in (("optim_step", service.optim_step), ("save_weights", service.save_weights),
                         ("load_weights", service.load_weights),
                         ("save_weights_for_sampler", service.save_weights_for_sampler)):
        app.add_api_route(f"/api/v1/{name}", future_route(submit), methods=["POST"], name=name)

    # -- sampling ---------------------------------------------------------------------------------
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        answer = await handled(request, service.create_sampling_session)
        return await asyncio.wrap_future(answer)

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler(sampler_id: str, request: Request):
        return service.sampler_info(tenant(request), sampler_id)

    def sample(who: str, body: dict) -> dict:
        try:
            return service.sample(who, body)
        except errors.InvalidInput as exc:
            return {"request_id": service.failed(who, exc), "sample_sequence_ids": []}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        return await handled(request, sample)

    # -- futures ----------------------------------------------------------------------------------
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        who, body = await small_json(request)
        pending = service.future(who, body.get("request_id"))
        waiter = asyncio.wrap_future(pending.future)
        done, _ = await asyncio.wait({waiter}, timeout=service.limits.poll_hold_s)
        if not done:
            state, reason = await pool.run(who, service.queue_state, pending)
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
    async def training_runs(request: Request):
        who = tenant(request)
        limit, offset = _query_int(request, "limit", 20), _query_int(request, "offset", 0)
        return await pool.run(who, service.training_runs, who, min(limit, 1000), offset)

    @app.get("/api/v1/training_runs/{run_id}")
    async def training_run(run_id: str, request: Request):
        who = tenant(request)
        return await pool.run(who, service.training_run, who, run_id)

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def checkpoints(run_id: str, request: Request):
        who = tenant(request)
        return await pool.run(who, service.checkpoints, who, run_id)

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request):
        who = tenant(request)
        await pool.run(who, service.delete_checkpoint, who, run_id, checkpoint_id)
        return Response(status_code=204)

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request):
        return await handled(request, service.weights_info)

    from plexrl.observe.web import mount_observability  # the operator's /metrics and /dashboard

    mount_observability(app, service)
    return app


def _query_int(request: Request, name: str, default: int) -> int:
    value = request.query_params.get(name)
    if value is None:
        return default
    if not (value.isascii() and value.isdigit() and len(value) <= 10 and int(value) <= MAX_OFFSET):
        raise BadRequest(f"query parameter {name}={_bounded(value, 40)!r}; expected an integer from 0 to {MAX_OFFSET}")
    return int(value)


def _bounded(text: str, chars: int = 2000) -> str:
    return text if len(text) <= chars else text[:chars] + f"... ({len(text):,} characters)"


def _error(status: int, message: str) -> JSONResponse:
    return JSON({"detail": message, "error": message}, status_code=status)


__all__ = ["create_app", "TooMany"]
