"""How `plexrl serve` answers on the wire when it refuses or fails: JSON in ASCII, and every HTTP
error with a JSON body naming the problem (the SDK takes an empty 4xx for a proxy's and retries it).

Statuses: 400 malformed or out-of-bounds input, 401 missing or unknown key, 404 anything that is
not the caller's (or an endpoint PlexRL does not serve, named), 405 a method a path does not take,
410 a finished session, 413 a body or a value over its limit, 429 past a tenant's limits. Bad
input never gets a 5xx; a bug does, as a 500 whose body names an incident (the log has its
traceback) and nothing else.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from plexrl.api import errors
from plexrl.serve import wire
from plexrl.serve.edge import EdgeError
from plexrl.serve.refusals import ServeError, cut

log = logging.getLogger("plexrl.serve")

PROTOBUF = "application/x-protobuf"


class JSON(JSONResponse):
    """JSON answers in ASCII: a value that is not valid Unicode (a lone surrogate in an old record)
    goes out escaped instead of failing the answer."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=True, separators=(",", ":")).encode("ascii")


def refusal(status: int, message: str) -> JSONResponse:
    return JSON({"detail": message, "error": message}, status_code=status)


async def _refused(request: Request, exc: ServeError | EdgeError):
    return refusal(exc.status, exc.message)


async def _bad_input(request: Request, exc: Exception):
    return refusal(400, cut(str(exc)))


async def _http_error(request: Request, exc: StarletteHTTPException):
    if exc.status_code == 404:
        return refusal(404, f"{request.method} {cut(request.url.path, 200)} is not an endpoint PlexRL serves "
                            "(it speaks the Tinker SDK's core protocol: see README)")
    if exc.status_code == 405:
        return refusal(405, f"{request.method} is not allowed on {cut(request.url.path, 200)}")
    return refusal(exc.status_code, cut(str(exc.detail)) or "error")


async def _server_error(request: Request, exc: Exception):
    incident = secrets.token_hex(6)
    log.error("internal error %s on %s %s", incident, request.method, request.url.path, exc_info=exc)
    return refusal(500, f"internal server error (incident {incident}; the server's log has the details)")


def install_refusals(app: FastAPI) -> None:
    """Every exception a route raises as the answer above."""
    app.add_exception_handler(ServeError, _refused)
    app.add_exception_handler(EdgeError, _refused)
    app.add_exception_handler(errors.InvalidInput, _bad_input)
    app.add_exception_handler(wire.WireError, _bad_input)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
