"""The tool sandbox: results, and every failure path returns instead of raising or hanging."""

from __future__ import annotations

import time

import pytest

from plexrl.tasks import sandbox


@pytest.mark.parametrize("code, ok, output, error", [
    ("print(6*7)", True, "42", ""),
    ("import sys; sys.exit(3)", False, "", "crash: exit status 3"),
    ("raise ValueError('boom')", False, "", "crash: ValueError: boom"),
    ("print('x' * 10000)", False, "", "output too long"),
    ("x = bytearray(8 * 1024**3)", False, "", "crash: MemoryError"),
    ("import os; print(os.environ.get('HOME'))", True, "None", ""),   # no environment leaks in
], ids=["ok", "exit-status", "exception", "too-much-output", "memory-limit", "empty-env"])
def test_run_python(code, ok, output, error):
    assert sandbox.run_python(code) == sandbox.ToolResult(ok, output, error)


@pytest.mark.parametrize("code", ["while True: pass", "import time; time.sleep(30)",
                                  "import os, time\nif os.fork() == 0: time.sleep(30)\ntime.sleep(30)"],
                         ids=["busy-loop", "sleep", "forked-child"])
def test_timeout_kills_and_returns_within_the_limit(code):
    started = time.monotonic()
    result = sandbox.run_python(code, timeout_s=0.5)
    assert result == sandbox.ToolResult(False, "", "timeout")
    assert time.monotonic() - started < 3.0, "a timed-out tool must not hold its caller"


@pytest.mark.parametrize("expression, ok, output", [
    ("23*47", True, "1081"),
    ("6/4", True, "3/2"),
    ("(1+2)*-3", True, "-9"),
    ("1/0", False, ""),
    ("2**10", False, ""),
    ("open('x')", False, ""),
], ids=["product", "fraction", "unary-minus", "div-zero", "power-refused", "call-refused"])
def test_calculator(expression, ok, output):
    result = sandbox.calculator(expression)
    assert (result.ok, result.output) == (ok, output)
    assert result.ok or result.error.startswith("bad expression")


# The in-process answer must equal the subprocess's (ok, output): it replaces it in every tool call.
@pytest.mark.parametrize("code", [
    "print(23*47)", "print(-7/2)", "print(7//2, 7%3)", "print(1/3)", "print(0.1+0.2)", "print()",
    "print(1/0)", "print(5%0)", "print(10**400)", "print(99999999999999999999*99999999999999999999)",
    "print(23*47", "print(23*47))", "print(x)", "print(len)", "print('a')", "print(*[1])",
    "print(1e308*10)", "print(-0.0)", "print(0x10+1_000)", "print(2**8)", "print(" + "9" * 300 + ")",
])
def test_print_arithmetic_matches_the_subprocess(code):
    fast, reference = sandbox.print_arithmetic(code), sandbox.run_python(code)
    if fast is not None:
        assert (fast.ok, fast.output) == (reference.ok, reference.output), code
        assert fast.ok or fast.error.startswith("crash") or fast.error == "output too long"


def test_print_arithmetic_leaves_other_code_to_the_subprocess():
    for code in ("print(x)", "print(len)", "print(2**8)", "import os", "print(*[1])", "print(1, sep='-')"):
        assert sandbox.print_arithmetic(code) is None, code
    assert sandbox.print_arithmetic("print(23*47)") == sandbox.ToolResult(True, "1081")


def test_service_waits_a_deterministic_latency_without_cpu():
    assert sandbox.service_latency_s("print(1)") == sandbox.service_latency_s("print(1)")
    assert 0.5 * 0.1 <= sandbox.service_latency_s("print(2)", 0.1) < 1.5 * 0.1
    started, cpu = time.perf_counter(), time.process_time()
    assert sandbox.call_service("print(6*7)", latency_s=0.2) == sandbox.ToolResult(True, "42")
    assert time.perf_counter() - started >= sandbox.service_latency_s("print(6*7)", 0.2)
    assert time.process_time() - cpu < 0.05, "a remote service's wait is a sleep, not work on our cores"
