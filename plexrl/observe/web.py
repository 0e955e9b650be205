"""The operator's HTTP routes: `/metrics` (Prometheus), `/dashboard` (the page), its data and its
files. Mounted on `plexrl serve`'s app (`mount_observability`), served alone by `plexrl run` and
`plexrl demo --metrics-port` (`observability_app`) and by `plexrl dashboard`.

Who may read: on a server with `--api-keys`, only an operator key (`@operator KEY` in the key
file), sent as `X-API-Key` or `Authorization: Bearer KEY` (what a Prometheus scrape config's
`authorization` sends); a tenant's key is refused, so no tenant sees another's jobs. The page
itself holds no data: it asks for the key when its data is refused, keeps it in the tab's
session storage and sends it as a header (never in a URL). Everything the page loads comes from
here (no CDN: it works offline).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from plexrl.observe import dashboard
from plexrl.observe.prometheus import CONTENT_TYPE, exposition

STATIC = Path(__file__).parent / "static"
FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
MAX_WINDOW_S = 3600.0


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def request_key(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    if key:
        return key
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else None


def window_of(request: Request) -> float:
    text = request.query_params.get("window", "")
    if not text:
        return dashboard.WINDOW_S
    try:
        value = float(text[:20])
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_WINDOW_S:
        raise Refused(400, f"window={text[:20]!r}; expected seconds of history to show, 0 < window <= {MAX_WINDOW_S:g}")
    return value


def mount(app: FastAPI, metrics: Callable[[], dict] | None, data: Callable[[float], dict],
          authorize: Callable[[str | None], None] = lambda key: None,
          tenants: Callable[[], dict[str, str]] | None = None) -> None:
    """Add the routes to `app`. `metrics`: the cluster's metrics() (None: no /metrics); `data(window_s)`:
    the dashboard's document; `authorize(key)` raises `Refused` for a key that may not read."""
    scrape = exposition(metrics, tenants) if metrics is not None else None

    async def guarded(request: Request, work: Callable[[], object]):
        try:
            authorize(request_key(request))
            return await asyncio.to_thread(work)
        except Refused as exc:
            return JSONResponse({"detail": exc.message, "error": exc.message}, status_code=exc.status)

    if scrape is not None:
        @app.get("/metrics")
        async def prometheus(request: Request):
            body = await guarded(request, scrape)
            return body if isinstance(body, Response) else Response(body, media_type=CONTENT_TYPE)

    @app.get("/dashboard")
    async def page():
        return FileResponse(STATIC / "dashboard.html", media_type="text/html")

    @app.get("/dashboard/data")
    async def document(request: Request):
        try:
            window = window_of(request)
        except Refused as exc:
            return JSONResponse({"detail": exc.message, "error": exc.message}, status_code=exc.status)
        body = await guarded(request, lambda: data(window))
        return body if isinstance(body, Response) else JSONResponse(body)

    @app.get("/dashboard/static/{name}")
    async def static(name: str):
        if name not in FILES:
            return JSONResponse({"detail": f"no file {name[:60]!r}", "error": "not found"}, status_code=404)
        return FileResponse(STATIC / name, media_type=FILES[name])


def cluster_data(cluster, tenants: Callable[[], dict[str, str]] | None = None) -> Callable[[float], dict]:
    return lambda window: dashboard.live(cluster.metrics(), cluster.recent(window), window,
                                         None if tenants is None else tenants())


def mount_observability(app: FastAPI, service) -> None:
    """`plexrl serve`'s hook: the operator's routes on its app, keyed by its tenants file."""

    def authorize(key: str | None) -> None:
        if service.tenants.is_operator(key):
            return
        if service.tenants.tenant_of(key) is not None:
            raise Refused(403, "a tenant's key cannot read the cluster's metrics; send an operator key "
                               "(a line '@operator KEY' in the --api-keys file)")
        raise Refused(401, "missing or unknown operator key; send it in the X-API-Key header or as "
                           "'Authorization: Bearer KEY'")

    def tenants() -> dict[str, str]:
        return {s.job: s.tenant for s in list(service.sessions.values())}

    mount(app, service.cluster.metrics, cluster_data(service.cluster, tenants), authorize, tenants)


def observability_app(cluster) -> FastAPI:
    """`/metrics` and `/dashboard` of one cluster, on an app of their own (`--metrics-port`)."""
    app = FastAPI(title="PlexRL metrics", docs_url=None, redoc_url=None, openapi_url=None)
    mount(app, cluster.metrics, cluster_data(cluster))
    return app


def serve_cluster(cluster, port: int, host: str = "127.0.0.1"):
    """A started `Server` (plexrl/serve/server.py) answering `/metrics` and `/dashboard` of `cluster`
    on `port` (0: a free one); stop it with `.stop()`."""
    from plexrl.serve.server import Server

    return Server(observability_app(cluster), host, port).start()


def add_metrics_port(parser, cluster: str = "the cluster") -> None:
    """`--metrics-port` of `plexrl run` and `plexrl demo`."""
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help=f"serve {cluster}'s Prometheus /metrics and its /dashboard on 127.0.0.1:PORT while "
                             "it runs (0: a free port, printed on stderr)")


@contextlib.contextmanager
def watched(cluster, port: int | None):
    """`/metrics` and `/dashboard` of `cluster` on `port` for the block's duration (nothing when None)."""
    if port is None:
        yield None
        return
    server = serve_cluster(cluster, port)
    print(f"plexrl: metrics on {server.url}/metrics, dashboard on {server.url}/dashboard", file=sys.stderr, flush=True)
    try:
        yield server
    finally:
        server.stop()
