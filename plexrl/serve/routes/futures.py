"""retrieve_future: a poll held up to `poll_hold_s`, then `try_again` with a queue state and a
reason saying what the request waits for and since when. A result the SDK reads as protobuf
(ForwardBackwardOutput, SampleResponse) goes as `application/x-protobuf`, the rest as JSON; a
failure is `{error, category}`."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from plexrl.serve.bodies import Named
from plexrl.serve.futures import Outcome
from plexrl.serve.responses import JSON, PROTOBUF
from plexrl.serve.routes.caller import Caller, caller, json_body

router = APIRouter(prefix="/api/v1", default_response_class=JSON)


@router.post("/retrieve_future")
async def retrieve_future(raw: bytes = Depends(json_body), who: Caller = Depends(caller)):
    requests = who.service.requests
    pending = requests.future(who.tenant, Named.decode(await who.small(raw), "request_id").name)
    waiter = asyncio.wrap_future(pending.future)
    done, _ = await asyncio.wait({waiter}, timeout=who.service.limits.poll_hold_s)
    if not done:
        state, reason = await who.run(requests.queue_state, pending)
        return {"type": "try_again", "request_id": pending.request_id, "queue_state": state,
                "queue_state_reason": reason}
    outcome: Outcome = waiter.result()
    requests.retrieved(pending)
    if outcome.proto is not None:
        return Response(outcome.proto, media_type=PROTOBUF)
    if outcome.error is not None:
        return {"error": outcome.error, "category": outcome.category}
    return outcome.json
