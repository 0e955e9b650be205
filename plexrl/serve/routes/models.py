"""Training models: create_model, get_info, forward(_backward), optim_step, and the checkpoint
calls (save_weights, save_weights_for_sampler, load_weights). Each POST that takes time only
enqueues its request and answers its id (`Caller.accepted`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from plexrl.serve import wire
from plexrl.serve.bodies import CreateModel, LoadWeights, Named, OptimStep, SaveForSampler, SaveWeights
from plexrl.serve.responses import JSON
from plexrl.serve.routes.caller import Caller, caller, json_body, protobuf_body

router = APIRouter(prefix="/api/v1", default_response_class=JSON)


@router.post("/create_model")
async def create_model(raw: bytes = Depends(json_body), who: Caller = Depends(caller)):
    service, most = who.service, who.service.limits.metadata_bytes
    return await who.handle(raw, lambda body: who.accepted(
        lambda: service.models.create(who.tenant, CreateModel.decode(body, most))))


@router.post("/get_info")
async def get_info(raw: bytes = Depends(json_body), who: Caller = Depends(caller)):
    return await who.handle(raw, lambda body: who.service.models.get_info(
        who.tenant, Named.decode(body, "model_id").name))


def _forward(who: Caller, raw: bytes, forward_only: bool | None) -> dict:
    def submit() -> str:
        request = wire.decode_forward_backward(raw, who.service.edge.max_request_values)
        return who.service.calls.forward_backward(who.tenant, request, len(raw), forward_only)

    return who.accepted(submit)


@router.post("/forward_backward")
async def forward_backward(raw: bytes = Depends(protobuf_body), who: Caller = Depends(caller)):
    return await who.run(_forward, who, raw, None)


@router.post("/forward")
async def forward(raw: bytes = Depends(protobuf_body), who: Caller = Depends(caller)):
    return await who.run(_forward, who, raw, True)


@router.post("/optim_step")
async def optim_step(raw: bytes = Depends(json_body), who: Caller = Depends(caller)):
    calls = who.service.calls
    return await who.handle(raw, lambda body: who.accepted(
        lambda: calls.optim_step(who.tenant, OptimStep.decode(body))))


@router.post("/save_weights")
async def save_weights(raw: bytes = Depends(json_body), who: Caller = Depends(caller)):
    saves = who.service.checkpoints
    return await who.handle(raw, lambda body: who.accepted(
        lambda: saves.save_weights(who.tenant, SaveWeights.decode(body))))


@router.post("/load_weights")
async def load_weights(raw: bytes = Depends(json_body), who: Caller = Depends(caller)):
    saves, most = who.service.checkpoints, who.service.limits.metadata_bytes
    return await who.handle(raw, lambda body: who.accepted(
        lambda: saves.load_weights(who.tenant, LoadWeights.decode(body, most))))


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(raw: bytes = Depends(json_body), who: Caller = Depends(caller)):
    saves = who.service.checkpoints
    return await who.handle(raw, lambda body: who.accepted(
        lambda: saves.save_weights_for_sampler(who.tenant, SaveForSampler.decode(body))))
