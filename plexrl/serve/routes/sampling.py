"""Sampling: create_sampling_session (answered directly: the SDK waits for the id), a sampler's
description, and asample (enqueued; bad input a failed request with no sequences)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends

from plexrl.api import errors
from plexrl.serve.bodies import CreateSamplingSession, Sample
from plexrl.serve.responses import JSON
from plexrl.serve.routes.caller import Caller, caller, json_body

router = APIRouter(prefix="/api/v1", default_response_class=JSON)


@router.post("/create_sampling_session")
async def create_sampling_session(raw: bytes = Depends(json_body), who: Caller = Depends(caller)):
    answer = await who.handle(raw, lambda body: who.service.samplers.create(
        who.tenant, CreateSamplingSession.decode(body)))
    return await asyncio.wrap_future(answer)


@router.get("/samplers/{sampler_id}")
async def sampler(sampler_id: str, who: Caller = Depends(caller)):
    return who.service.samplers.info(who.tenant, sampler_id)


def _sample(who: Caller, body: dict) -> dict:
    service = who.service
    try:
        return service.samplers.sample(who.tenant, Sample.decode(body, service.max_sampled_tokens))
    except errors.InvalidInput as exc:
        return {"request_id": service.requests.failed(who.tenant, exc), "sample_sequence_ids": []}


@router.post("/asample")
async def asample(raw: bytes = Depends(json_body), who: Caller = Depends(caller)):
    return await who.handle(raw, lambda body: _sample(who, body))
