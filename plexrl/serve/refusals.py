"""How `plexrl serve` says no: the HTTP-level refusals the service raises (the app turns each into
its status and a JSON body naming the problem), and the tenant-scoped lookup behind every 404.

Invariants:
- another tenant's record is refused exactly as one that does not exist (`owned`): the same
  status, the same message;
- a refusal's message is cut to `MESSAGE_CHARS` (`cut`): it never echoes a large value back.
"""

from __future__ import annotations

from typing import Any

from plexrl.api.types import shown

MESSAGE_CHARS = 2000  # a failure's message is cut to this: a refusal never echoes a large value


class ServeError(Exception):
    """An HTTP-level answer (responses.py turns it into its status and a JSON body naming the problem)."""

    status = 400

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(ServeError):
    status = 400


class Unauthorized(ServeError):
    status = 401


class NotFound(ServeError):
    status = 404


class Gone(ServeError):
    status = 410


class TooMany(ServeError):
    status = 429


def cut(text: str, chars: int = MESSAGE_CHARS) -> str:
    return text if len(text) <= chars else text[:chars] + f"... ({len(text):,} characters)"


def owned(table: dict, tenant: str, key: Any, what: str):
    """`table[key]` when it is the tenant's; NotFound otherwise, the same for another tenant's
    record as for one that does not exist."""
    record = table.get(key) if isinstance(key, str) else None
    if record is None or record.tenant != tenant:
        raise NotFound(f"no {what} {shown(key)}")
    return record
