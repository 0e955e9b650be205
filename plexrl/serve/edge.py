"""The edge of `plexrl serve`: every request's body is bounded and decoded before any work starts,
and never on the event loop that answers every tenant.

What a body may be (`EdgeLimits`; a body past any limit is a 4xx naming the field and the limit):
- its size: `max_body_bytes` for a protobuf forward_backward (the SDK sends chunks of ~5 MB),
  `max_json_bytes` for every JSON body (the largest the SDK sends is an asample prompt);
- a JSON body: an object, nested at most `max_json_depth` levels, holding at most
  `max_json_items` values, each string at most `max_string_chars` characters of valid Unicode
  (no lone surrogate), each number finite and each integer within int64;
- a forward_backward: at most `max_request_values` tokens and tensor values in all, counted from
  the shapes before anything is densified (wire.py caps each tensor; this caps the request).

Where the work runs: `TenantPool` runs the parsing and the service's handling of a request on a
thread pool, at most `tenant_share` of its `workers` threads for one tenant at a time, so a
tenant that sends expensive bodies waits for its own threads while the event loop and the other
tenants' threads go on. The loop itself only reads bytes and resolves the tenant.

Pure apart from the pool: the checks take bytes and limits and return values or raise BadRequest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from plexrl.api.types import shown

T = TypeVar("T")

INT64 = (-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True)
class EdgeLimits:
    max_body_bytes: int = 32 << 20  # a protobuf forward_backward
    max_json_bytes: int = 4 << 20  # any JSON body (a 100k-token prompt is ~0.7 MB)
    max_json_depth: int = 32  # the SDK's deepest body nests 5 levels
    max_json_items: int = 1 << 20  # values in one JSON body
    max_string_chars: int = 4096  # one JSON string (names, paths, metadata values, stop strings)
    max_request_values: int = 1 << 22  # tokens + tensor values in one forward_backward (3x the SDK's 5 MB chunk)
    workers: int = 8  # threads that parse and handle requests
    tenant_share: int = 4  # of them, how many one tenant's requests may hold at once

    def validate(self) -> None:
        from plexrl.api import errors

        bad = [f"{name}={getattr(self, name)!r}" for name in self.__dataclass_fields__
               if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1)]
        if bad:
            raise errors.ConfigError(f"edge limits {', '.join(bad)}; expected integers >= 1")
        if self.tenant_share > self.workers:
            raise errors.ConfigError(f"tenant_share={self.tenant_share} is more than workers={self.workers}; "
                                     "expected a share of the workers")


class EdgeError(Exception):
    """A body refused at the edge: `status` (400 or 413) and a message naming the field and the limit."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


# ---------------------------------------------------------------------------- JSON

def parse_json(raw: bytes, limits: EdgeLimits, what: str = "request body") -> dict:
    """`raw` as a JSON object within `limits`; EdgeError naming what is wrong otherwise."""
    if len(raw) > limits.max_json_bytes:
        raise EdgeError(f"{what} of {len(raw):,} bytes; a JSON body may have at most {limits.max_json_bytes:,}", 413)
    try:
        value = json.loads(raw or b"{}", parse_constant=_no_constant)
    except RecursionError:
        raise EdgeError(f"{what} nests deeper than this server parses; expected at most "
                        f"{limits.max_json_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise EdgeError(f"{what} is not valid JSON ({_short(exc)}); expected a JSON object") from None
    if not isinstance(value, dict):
        raise EdgeError(f"{what} is a JSON {type(value).__name__}; expected a JSON object")
    check_json(value, limits, what)
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def check_json(value: Any, limits: EdgeLimits, what: str = "request body") -> None:
    """Depth, item count, strings and numbers of a parsed JSON value, walked without recursion;
    EdgeError naming the first place (a JSON path) that breaks a limit."""
    stack: list[tuple[Any, str, int]] = [(value, "$", 1)]
    items = 0
    while stack:
        node, path, depth = stack.pop()
        items += 1
        if items > limits.max_json_items:
            raise EdgeError(f"{what} holds more than {limits.max_json_items:,} values; expected at most that many", 413)
        if isinstance(node, dict):
            if depth > limits.max_json_depth:
                raise EdgeError(f"{what} nests deeper than {limits.max_json_depth} levels at {path}")
            for key, child in node.items():
                _check_string(key, f"{path} (a key)", limits, what)
                stack.append((child, f"{path}.{_shown_key(key)}", depth + 1))
        elif isinstance(node, list):
            if depth > limits.max_json_depth:
                raise EdgeError(f"{what} nests deeper than {limits.max_json_depth} levels at {path}")
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(node))
        elif isinstance(node, str):
            _check_string(node, path, limits, what)
        elif isinstance(node, bool) or node is None:
            continue
        elif isinstance(node, int):
            if not INT64[0] <= node <= INT64[1]:
                raise EdgeError(f"{what}: {path} is an integer of {len(str(abs(node)))} digits; expected one "
                                "that fits 64 bits")
        elif isinstance(node, float) and not math.isfinite(node):
            raise EdgeError(f"{what}: {path}={node}; expected a finite number")


def _check_string(text: str, path: str, limits: EdgeLimits, what: str) -> None:
    if len(text) > limits.max_string_chars:
        raise EdgeError(f"{what}: {path} is a string of {len(text):,} characters; expected at most "
                        f"{limits.max_string_chars:,}", 413)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise EdgeError(f"{what}: {path} holds a lone surrogate (such as \\ud800); expected valid Unicode "
                            "text") from None


def _shown_key(key: str) -> str:
    return key if key.isidentifier() and len(key) <= 40 else shown(key)


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:200] + "..."


# ---------------------------------------------------------------------------- the pool

class TenantPool:
    """A thread pool of which one tenant holds at most `share` threads at a time (the rest of
    its requests wait for one of its own, in arrival order)."""

    def __init__(self, workers: int, share: int):
        self.share = share
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="plexrl-edge")
        self._slots: dict[str, asyncio.Semaphore] = {}

    async def run(self, tenant: str, fn: Callable[..., T], *args) -> T:
        slots = self._slots.get(tenant)
        if slots is None:
            slots = self._slots[tenant] = asyncio.Semaphore(self.share)
        async with slots:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
