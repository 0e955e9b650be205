"""Batched calls: which queued calls of a state join its dispatched head's device call, and what
such a batch is estimated to take (scheduler.py's docstring: batched sampling).

Only `sample` and `compute_logprobs` calls batch (functions.BATCHED), and only the calls of one
state: one set of weights, one job. Such calls are pure functions of the weights and their
payload (a sample carries its seed, and a row's result does not depend on its batch), so running
them together changes no result (a vLLM state's engine gets the batch's samples in one request).
Invariant: the calls joined to a head fit the KV positions the device's activation reserve holds
(StateManager.decode_positions) beside the head, which goes whatever its size; calls that arrive
while a batch runs go into the next one. Runs under the node's lock (the queue is the scheduler's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from plexrl.backends import slot_decode
from plexrl.policy import GroupQueue
from plexrl.runtime.state import ModelState
from plexrl.runtime.telemetry import Telemetry

if TYPE_CHECKING:
    from plexrl.runtime.scheduler import Request


def coalesce(head: Request, queue: GroupQueue[Request], decode_positions: Callable[[str], int]) -> None:
    """Move the calls queued right behind a dispatched `sample` or `compute_logprobs` `head` that
    are such calls too into its device call (`head.batch`), while their KV positions fit
    `decode_positions(state)` (asked only when the head is such a call)."""
    used = head.positions()
    if used is None:
        return
    head.batch = []
    budget = decode_positions(head.state_id)
    while (following := queue.next(head.state_id)) is not None:
        positions = following.positions()
        if positions is None or used + positions > budget:
            return
        used += positions
        head.batch.append(queue.take_next(head.state_id))


def decode_estimate(telemetry: Telemetry, primary: str, queued, budget: int, state: ModelState) -> float | None:
    """The decode model's estimate (policy/decode.py, fitted to `primary`'s batched calls) of the
    batch `coalesce` would make of a sample head and the sample calls `queued` behind it now
    (`queued` starts with the head), within `budget` KV positions; None until it is fitted."""
    rows, used = [], 0
    for call in queued:
        positions = call.positions()
        if call.fn != "sample" or positions is None or (rows and used + positions > budget):
            break
        used += positions
        rows.append((call.payload.num_samples, len(call.payload.tokens), call.payload.params.max_tokens))
    positions = state.module.config.max_position_embeddings
    length = slot_decode.cache_len(max(prompt + tokens for _, prompt, tokens in rows), positions)
    slots = slot_decode.slot_count(sum(n for n, _, _ in rows), length, budget)
    return telemetry.decode_estimate(primary, rows, slots)
