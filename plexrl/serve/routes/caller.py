"""What every route of `plexrl serve` depends on (FastAPI dependencies): who is calling, their
body read within its limit, and where the work runs.

Where the work runs (plexrl/serve/edge.py): the event loop reads bodies (bounded before they are
read whole) and resolves tenants; parsing, decoding and the service's handling run on the edge's
`TenantPool`, at most a share of it per tenant, in one trip. Only `retrieve_future` and the
heartbeat, whose bodies are a few dozen bytes, are parsed on the loop, and only when under
`INLINE_BYTES`.

Order: the tenant is resolved (401) before a body is read (413), and a protobuf body's type is
checked before it is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

from fastapi import Depends, Request

from plexrl.api import errors
from plexrl.serve.edge import EdgeError, TenantPool, parse_json
from plexrl.serve.refusals import BadRequest, cut
from plexrl.serve.responses import PROTOBUF
from plexrl.serve.service import TinkerService

T = TypeVar("T")

INLINE_BYTES = 1024  # a poll's or a heartbeat's body this small is parsed on the loop (bounded like a header)
MAX_OFFSET = (1 << 31) - 1  # listing offsets and limits past it are refused


@dataclass(frozen=True)
class Caller:
    """A request's tenant, with the service that answers it and the pool its work runs on."""

    tenant: str
    service: TinkerService
    pool: TenantPool

    async def run(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on the tenant's share of the pool."""
        return await self.pool.run(self.tenant, fn, *args)

    async def handle(self, raw: bytes, handle: Callable[[dict], T]) -> T:
        """A JSON body parsed and handled on the tenant's share of the pool."""
        limits = self.service.edge
        return await self.pool.run(self.tenant, lambda: handle(parse_json(raw, limits)))

    async def small(self, raw: bytes) -> dict:
        """A body that is a few dozen bytes when well-formed: parsed on the loop when it is small."""
        if len(raw) <= INLINE_BYTES:
            return parse_json(raw, self.service.edge)
        return await self.pool.run(self.tenant, parse_json, raw, self.service.edge)

    def accepted(self, submit: Callable[[], str]) -> dict:
        """A future-type POST: bad input the service refuses at once becomes a failed request
        (RequestFailedError, category user, in the SDK) rather than an HTTP error, so the
        caller's client stays usable; malformed bodies are 4xx before this."""
        try:
            return {"request_id": submit()}
        except errors.InvalidInput as exc:
            return {"request_id": self.service.requests.failed(self.tenant, exc)}


async def caller(request: Request) -> Caller:
    service: TinkerService = request.app.state.service
    return Caller(service.tenant(request.headers.get("x-api-key")), service, request.app.state.pool)


async def json_body(request: Request, who: Caller = Depends(caller)) -> bytes:
    return await _read(request, who.service.edge.max_json_bytes)


async def protobuf_body(request: Request, who: Caller = Depends(caller)) -> bytes:
    kind = request.headers.get("content-type", "")
    if "json" in kind:
        raise BadRequest(f"{request.url.path.rsplit('/', 1)[-1]} takes a protobuf ForwardBackwardRequest "
                         f"(Content-Type {PROTOBUF}), as the Tinker SDK 0.38 sends it; got {cut(kind, 100)}")
    return await _read(request, who.service.edge.max_body_bytes)


@dataclass(frozen=True)
class Page:
    limit: int
    offset: int


async def page(request: Request, who: Caller = Depends(caller)) -> Page:
    """A listing's `limit` (default 20, at most 1000) and `offset` (default 0) query parameters."""
    limit, offset = _query_int(request, "limit", 20), _query_int(request, "offset", 0)
    return Page(min(limit, 1000), offset)


async def _read(request: Request, limit: int) -> bytes:
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


def _query_int(request: Request, name: str, default: int) -> int:
    value = request.query_params.get(name)
    if value is None:
        return default
    if not (value.isascii() and value.isdigit() and len(value) <= 10 and int(value) <= MAX_OFFSET):
        raise BadRequest(f"query parameter {name}={cut(value, 40)!r}; expected an integer from 0 to {MAX_OFFSET}")
    return int(value)
