"""Start-up and sessions: client config, health, capabilities, create_session, heartbeats, finish."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from plexrl.serve.bodies import CreateSession, Named
from plexrl.serve.responses import JSON
from plexrl.serve.routes.caller import Caller, caller, json_body

router = APIRouter(prefix="/api/v1", default_response_class=JSON)


@router.post("/client/config")
async def client_config(raw: bytes = Depends(json_body), who: Caller = Depends(caller)):
    await who.handle(raw, lambda body: None)
    return who.service.client_flags  # {}: the SDK's defaults (API-key auth, client-side custom losses, per-request polls)


@router.get("/healthz")
async def healthz():
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(who: Caller = Depends(caller)):
    return who.service.catalog.capabilities()


@router.post("/create_session")
async def create_session(raw: bytes = Depends(json_body), who: Caller = Depends(caller)):
    metadata_bytes = who.service.limits.metadata_bytes
    return await who.handle(raw, lambda body: who.service.sessions.create(
        who.tenant, CreateSession.decode(body, metadata_bytes).user_metadata))


@router.post("/session_heartbeat")
async def heartbeat(raw: bytes = Depends(json_body), who: Caller = Depends(caller)):
    body = Named.decode(await who.small(raw), "session_id")
    return who.service.sessions.heartbeat(who.tenant, body.name)


@router.post("/sessions/{session_id}/finish")
async def finish(session_id: str, raw: bytes = Depends(json_body), who: Caller = Depends(caller)):
    # the body is read (within its limit) and not used: finish takes its session from the path
    return await who.run(who.service.finish_session, who.tenant, session_id)
