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

Threads share one interpreter, and decoding a large body holds it (the JSON and protobuf decoders
are C code that never lets go): a tenant's share of threads alone does not keep its parsing from
stalling everyone. So each tenant also has a budget of the pool's CPU time (`tenant_cpu`, CPU
seconds per second, refilled continuously up to one second's worth): what its requests spent on
their threads is charged to it, and while it is in debt its next request waits on the loop (not
on a thread) until the debt is paid. A tenant whose requests are the SDK's few hundred bytes never
gets near it; one that sends bodies at the limits gets through about `tenant_cpu` of a core.

Pure apart from the pool: the checks take bytes and limits and return values or raise BadRequest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import time
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
    tenant_cpu: float = 0.2  # CPU seconds a second one tenant's requests may spend on them, on average

    @classmethod
    def for_context(cls, tokens: int | None, **given) -> "EdgeLimits":
        """Limits sized to the longest context among the served models: the largest JSON body the
        SDK sends is an asample prompt, and a prompt longer than the context is refused anyway, so
        a JSON body may hold 12 bytes and 2 values a token of it (a token id, a comma, a space) on
        top of 64 KiB for the rest; a forward_backward, the SDK's 5 MB chunk of values or one datum
        of four fields at full context, whichever is more. Decoding a body holds the interpreter
        (~40 ms a MiB of JSON, ~25 ms a million values of protobuf): limits no model needs are
        stalls any tenant could cause. `given` overrides any field; `tokens` None keeps the
        defaults."""
        if tokens is not None and tokens > 0:
            derived = {"max_json_bytes": (64 << 10) + 12 * tokens, "max_json_items": 4096 + 2 * tokens,
                       "max_request_values": max(5_000_000 // 4, 4 * tokens)}
            given = {**derived, **given}
        return cls(**given)

    def validate(self) -> None:
        from plexrl.api import errors

        bad = [f"{name}={getattr(self, name)!r}" for name in self.__dataclass_fields__ if name != "tenant_cpu"
               and not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1)]
        if not (isinstance(self.tenant_cpu, (int, float)) and self.tenant_cpu > 0):
            bad.append(f"tenant_cpu={self.tenant_cpu!r}")
        if bad:
            raise errors.ConfigError(f"edge limits {', '.join(bad)}; expected integers >= 1 (tenant_cpu: a number > 0)")
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
            if items + len(node) > limits.max_json_items:
                raise EdgeError(f"{what} holds more than {limits.max_json_items:,} values; expected at most that many",
                                413)
            if _numbers_within(node, path, what):  # a list of numbers (tokens): checked at C speed
                items += len(node)
            else:
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


def _numbers_within(values: list, path: str, what: str) -> bool:
    """Whether `values` is a non-empty list of numbers only (EdgeError if one is past int64 or not
    finite), found with min and max in C; False for anything else, which is walked one by one."""
    if not values or not all(map(_NUMBER_TYPES.__contains__, map(type, values))):
        return False
    low, high = min(values), max(values)
    for extreme in (low, high):
        if isinstance(extreme, float) and not math.isfinite(extreme):
            raise EdgeError(f"{what}: {path} holds {extreme}; expected finite numbers")
        if isinstance(extreme, int) and not INT64[0] <= extreme <= INT64[1]:
            raise EdgeError(f"{what}: {path} holds an integer of {len(str(abs(extreme)))} digits; expected ones "
                            "that fit 64 bits")
    return True


_NUMBER_TYPES = frozenset((int, float))  # bool is a type of its own: never a number here


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

class CpuBudget:
    """A tenant's budget of CPU seconds: refilled at `rate` a second up to `rate` (one second's
    worth), charged with what its requests spent; `wait_s` is how long it is in debt."""

    def __init__(self, rate: float, now: float):
        self.rate = rate
        self.balance = rate
        self._at = now

    def _refill(self, now: float) -> None:
        self.balance = min(self.rate, self.balance + (now - self._at) * self.rate)
        self._at = now

    def wait_s(self, now: float) -> float:
        self._refill(now)
        return max(0.0, -self.balance / self.rate)

    def charge(self, cpu_s: float, now: float) -> None:
        self._refill(now)
        self.balance -= cpu_s


class TenantPool:
    """A thread pool of which one tenant holds at most `share` threads at a time (the rest of
    its requests wait for one of its own, in arrival order) and spends at most `cpu` CPU seconds a
    second on average (`CpuBudget`)."""

    def __init__(self, workers: int, share: int, cpu: float = 0.2):
        self.share = share
        self.cpu = cpu
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="plexrl-edge")
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._budgets: dict[str, CpuBudget] = {}

    async def run(self, tenant: str, fn: Callable[..., T], *args) -> T:
        slots = self._slots.get(tenant)
        if slots is None:
            slots = self._slots[tenant] = asyncio.Semaphore(self.share)
            self._budgets[tenant] = CpuBudget(self.cpu, time.monotonic())
        budget = self._budgets[tenant]
        async with slots:
            wait = budget.wait_s(time.monotonic())
            if wait > 0:
                await asyncio.sleep(wait)
            spent, value = await asyncio.get_running_loop().run_in_executor(self._executor, _timed, fn, args)
            budget.charge(spent, time.monotonic())
        return value.result()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _timed(fn: Callable[..., T], args: tuple) -> "tuple[float, concurrent.futures.Future[T]]":
    """`fn(*args)` and the CPU time its thread spent on it; its outcome as a done future, so a
    refusal is charged like an answer."""
    outcome: concurrent.futures.Future = concurrent.futures.Future()
    started = time.thread_time()
    try:
        outcome.set_result(fn(*args))
    except BaseException as exc:
        outcome.set_exception(exc)
    return time.thread_time() - started, outcome
