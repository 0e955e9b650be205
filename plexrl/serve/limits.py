"""What one tenant may hold on `plexrl serve`, and how long the server keeps what it holds.

Past a bound a request is refused (429, plexrl/serve/futures.py and sessions.py); every bound is a
number > 0 (`validate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from plexrl.api import errors


@dataclass(frozen=True)
class Limits:
    sessions_per_tenant: int = 16
    queued_per_tenant: int = 1024  # requests submitted and not yet finished
    queued_bytes_per_tenant: int = 1 << 30  # the payloads (bodies) of those requests, in bytes
    kept_per_tenant: int = 4096  # request records held (queued, and finished ones kept for polls)
    seq_window: int = 1024  # a model's seq_id may run at most this far ahead of the next one it expects
    metadata_bytes: int = 16 << 10  # a user_metadata object, as JSON
    session_timeout_s: float = 120.0  # a session without heartbeats this long is finished
    poll_hold_s: float = 25.0  # retrieve_future holds a poll this long before try-again (< 45 s)
    gap_s: float = 30.0  # a model's missing seq_id is waited for this long
    retention_s: float = 300.0  # a result is kept this long after it was retrieved (the SDK may poll again after
    # a transport error, and a retried submission returns it); one never retrieved, 12 times as long

    def validate(self) -> None:
        bad = [f"{name}={getattr(self, name)!r}" for name in self.__dataclass_fields__
               if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) > 0)]
        if bad:
            raise errors.ConfigError(f"serve limits {', '.join(bad)}; expected numbers > 0")
