"""Run a tool call for an agentic rollout: a Python snippet in a subprocess, or a calculator.

A tool never raises and never hangs its caller: a timeout, a crash, a memory blow-up or too
much output all come back as a `ToolResult` with `ok=False` and the reason, and the task
scores that turn zero. The Python tool runs `python -I -S` (isolated: no site, no user paths,
no environment) in a fresh temporary directory, in its own process group so a timeout kills
everything it started, with CPU-time and address-space limits set inside the child (setting
them from `preexec_fn` is unsafe in a threaded controller). This is a guard against accidents,
not a security boundary for hostile code.

The wall time spent here is real device-idle time for the job: exactly the gap PlexRL fills.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from plexrl.tasks import arith

DEFAULT_TIMEOUT_S = 2.0
MAX_OUTPUT_CHARS = 256
MEMORY_LIMIT_BYTES = 512 * 1024 * 1024

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


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.communicate()
