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
