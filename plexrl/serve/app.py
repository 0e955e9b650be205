"""The HTTP face of `plexrl serve`: the Tinker SDK 0.38.0 protocol (see ../shared/TINKER.md) over
FastAPI, on a `TinkerService` (plexrl/serve/service.py) that holds the state.

The routes are FastAPI routers, one per part of the protocol (plexrl/serve/routes/), reading
their caller and body through dependencies (routes/caller.py); refusals and failures are answered
as responses.py describes. A POST of a request that takes time (create_model, forward_backward,
optim_step, save/load weights, asample) only enqueues it and answers `{request_id}` at once;
`retrieve_future` holds a poll, then answers `try_again` (routes/futures.py).

The app holds no state of its own: the service and the edge's `TenantPool` are on `app.state`.
"""

from __future__ import annotations

from fastapi import FastAPI

from plexrl.serve.edge import TenantPool
from plexrl.serve.responses import JSON, install_refusals
from plexrl.serve.routes import futures, models, runs, sampling, sessions
from plexrl.serve.service import TinkerService


def create_app(service: TinkerService) -> FastAPI:
    # redirect_slashes off: a path whose id is "/" (training_runs/%2F) would get a 307 with an empty
    # body, which the SDK takes for a proxy's answer; it gets a 404 that names it instead
    app = FastAPI(title="PlexRL (Tinker-compatible)", docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=JSON, redirect_slashes=False)
    app.state.service = service
    limits = service.edge
    app.state.pool = TenantPool(limits.workers, limits.tenant_share, limits.tenant_cpu)
    service.on_close(app.state.pool.close)
    install_refusals(app)
    for part in (sessions, models, sampling, futures, runs):
        app.include_router(part.router)

    from plexrl.observe.web import mount_observability  # the operator's /metrics and /dashboard

    mount_observability(app, service)
    return app
