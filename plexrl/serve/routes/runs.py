"""A tenant's training runs and checkpoints (REST): listings, one run, its checkpoints, deleting
one, and weights_info."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from plexrl.serve.bodies import Named
from plexrl.serve.responses import JSON
from plexrl.serve.routes.caller import Caller, Page, caller, json_body, page

router = APIRouter(prefix="/api/v1", default_response_class=JSON)


@router.get("/training_runs")
async def training_runs(listing: Page = Depends(page), who: Caller = Depends(caller)):
    return await who.run(who.service.runs.training_runs, who.tenant, listing.limit, listing.offset)


@router.get("/training_runs/{run_id}")
async def training_run(run_id: str, who: Caller = Depends(caller)):
    return await who.run(who.service.runs.training_run, who.tenant, run_id)


@router.get("/training_runs/{run_id}/checkpoints")
async def checkpoints(run_id: str, who: Caller = Depends(caller)):
    return await who.run(who.service.runs.checkpoints, who.tenant, run_id)


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(run_id: str, checkpoint_id: str, who: Caller = Depends(caller)):
    await who.run(who.service.runs.delete_checkpoint, who.tenant, run_id, checkpoint_id)
    return Response(status_code=204)


@router.post("/weights_info")
async def weights_info(raw: bytes = Depends(json_body), who: Caller = Depends(caller)):
    return await who.handle(raw, lambda body: who.service.runs.weights_info(
        who.tenant, Named.decode(body, "tinker_path").name))
