"""Run a tool call for an agentic rollout: a Python snippet in a subprocess, or a calculator.

A tool never raises and never hangs its caller: a timeout, a crash, a memory blow-up or too
much output all come back as a `ToolResult` with `ok=False` and the reason, and the task
scores that turn zero. The Python tool runs `python -I -S` (isolated: no site, no user paths,
no environment) in a fresh temporary directory, in its own process group so a timeout kills
everything it started, with CPU-time and address-space limits set inside the child (setting
them from `preexec_fn` is unsafe in a threaded controller). This is a guard against accidents,
not a security boundary for hostile code.

`call_service` is how the tool task calls it: in a real cluster the sandbox is a service that
runs elsewhere (its own machines), so the job's devices only wait for it. The call waits a
deterministic latency (`service_latency_s`, a function of the call text: a sleep, no CPU) and
returns what `run_python` would: a `print` of number literals and + - * / // % is answered in
process (`print_arithmetic`, microseconds), anything else really runs in the subprocess. So the
demo's two cores stay with its devices, and a reply — hence a reward — is the same as before.
The wall time spent here is real device-idle time for the job: exactly the gap PlexRL fills.
"""

from __future__ import annotations

import ast
import hashlib
import operator
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from plexrl.tasks import arith

DEFAULT_TIMEOUT_S = 2.0
MAX_OUTPUT_CHARS = 256
MEMORY_LIMIT_BYTES = 512 * 1024 * 1024
# Median round trip of one sandbox call: what `run_python` of a one-liner costs on a laptop core
# (~18 ms measured), so the tool job's timeline keeps its shape; only the CPU burn goes away.
SERVICE_LATENCY_S = 0.02
# Longest snippet answered in process; longer ones run in the subprocess.
MAX_INPROCESS_CHARS = 64

# Runs first in the child: limits, then the snippet from argv (never interpolated into source).
_PRELUDE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_CPU, ({cpu_s}, {cpu_s}))
resource.setrlimit(resource.RLIMIT_AS, ({mem}, {mem}))
code = sys.argv[1]
del sys.argv[1]
exec(compile(code, "<tool>", "exec"), {{"__name__": "__main__"}})
"""


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    output: str
    error: str = ""  # "" when ok; else "timeout", "crash: ...", "output too long", "bad expression: ..."


def run_python(code: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> ToolResult:
    prelude = _PRELUDE.format(cpu_s=max(1, int(timeout_s) + 1), mem=MEMORY_LIMIT_BYTES)
    with tempfile.TemporaryDirectory(prefix="plexrl-tool-") as workdir:
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", prelude, code],
            cwd=workdir, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, text=True,
        )
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            return ToolResult(False, "", "timeout")
    if process.returncode != 0:
        last_line = (stderr.strip().splitlines() or [f"exit status {process.returncode}"])[-1]
        return ToolResult(False, "", f"crash: {last_line[:120]}")
    if len(stdout) > MAX_OUTPUT_CHARS:
        return ToolResult(False, "", "output too long")
    return ToolResult(True, stdout.strip())


def calculator(expression: str) -> ToolResult:
    try:
        return ToolResult(True, arith.format_value(arith.evaluate(expression)))
    except arith.ArithError as error:
        return ToolResult(False, "", f"bad expression: {error}")


def call_service(code: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                 latency_s: float = SERVICE_LATENCY_S) -> ToolResult:
    """`run_python(code)` as a remote sandbox answers it: after `service_latency_s(code)`."""
    started = time.perf_counter()
    result = print_arithmetic(code)
    if result is None:
        result = run_python(code, timeout_s)
    time.sleep(max(0.0, service_latency_s(code, latency_s) - (time.perf_counter() - started)))
    return result


def service_latency_s(call: str, median_s: float = SERVICE_LATENCY_S) -> float:
    """A deterministic latency in [0.5, 1.5) x `median_s`, drawn from a hash of the call text."""
    digest = hashlib.blake2b(call.encode(), digest_size=8).digest()
    return median_s * (0.5 + int.from_bytes(digest, "little") / 2**64)


_NUMBER_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def print_arithmetic(code: str) -> ToolResult | None:
    """`run_python(code)`'s `ok` and `output` for `print(...)` of int/float literal arithmetic,
    computed here with Python's own operators; None for any other snippet (run it for real).
    An exception is a crash, as in the child (its `error` text may be worded differently)."""
    if len(code) > MAX_INPROCESS_CHARS:
        return None
    try:
        tree = ast.parse(code)
    except SyntaxError as error:
        return ToolResult(False, "", f"crash: SyntaxError: {error.msg}")
    except ValueError:  # a NUL byte: leave it to run_python, whatever it does with one
        return None
    if not (len(tree.body) == 1 and isinstance(call := tree.body[0], ast.Expr) and isinstance(call := call.value, ast.Call)
            and isinstance(call.func, ast.Name) and call.func.id == "print" and not call.keywords
            and all(_is_arithmetic(argument) for argument in call.args)):
        return None
    try:
        stdout = " ".join(str(_number(argument)) for argument in call.args) + "\n"
    except (ArithmeticError, ValueError) as error:
        return ToolResult(False, "", f"crash: {type(error).__name__}: {error}")
    if len(stdout) > MAX_OUTPUT_CHARS:
        return ToolResult(False, "", "output too long")
    return ToolResult(True, stdout.strip())


def _is_arithmetic(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float)
    if isinstance(node, ast.UnaryOp):
        return type(node.op) in _NUMBER_OPS and _is_arithmetic(node.operand)
    if isinstance(node, ast.BinOp):
        return type(node.op) in _NUMBER_OPS and _is_arithmetic(node.left) and _is_arithmetic(node.right)
    return False


def _number(node: ast.expr):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp):
        return _NUMBER_OPS[type(node.op)](_number(node.operand))
    return _NUMBER_OPS[type(node.op)](_number(node.left), _number(node.right))


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.communicate()
