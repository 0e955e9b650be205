"""An agentic two-turn task: the model calls a tool, reads its output, then answers.

Prompt `'23*47?'`. Turn 1 is a tool call, `print(23*47)` (a Python snippet for the sandbox
service, `sandbox.call_service`) or `calc(23*47)` (the calculator); the environment replies
`'>1081\\n'` (or `'>error\\n'` when the tool fails, times out or the call is malformed). Turn 2
is the final answer, `'1081'`, verified exactly. An answer given directly in turn 1 is graded too.
The products are too hard for a tiny model to compute, so reward comes from using the tool
and copying its output: tool latency is on the critical path of every rollout. Both tools stand
for services elsewhere in the cluster and answer after `latency_s` (median; a deterministic
function of the call text, a sleep that uses no CPU, so it never changes a reply or a reward).
"""

from __future__ import annotations

import re
import time

import numpy as np

from plexrl.tasks import sandbox
from plexrl.tasks.base import Problem

_TOOL_CALL = re.compile(r"^(print|calc)\((.*)\)$")
TOOLS = ("python", "calculator")


class ToolUseTask:
    name = "tool_use"
    max_turns = 2

    def __init__(self, tool: str = "python", timeout_s: float = sandbox.DEFAULT_TIMEOUT_S,
                 latency_s: float = sandbox.SERVICE_LATENCY_S):
        if tool not in TOOLS:
            raise ValueError(f"tool={tool!r} (expected one of {TOOLS})")
        if not latency_s >= 0:
            raise ValueError(f"tool latency_s={latency_s!r} (expected seconds >= 0)")
        self.tool, self.timeout_s, self.latency_s = tool, timeout_s, latency_s

    def sample_problem(self, rng: np.random.Generator) -> Problem:
        a, b = (int(x) for x in rng.integers(10, 100, size=2))
        return Problem(prompt=f"{a}*{b}?", answer=str(a * b), numbers=(a, b), target=a * b)

    def demonstration(self, problem: Problem) -> list[tuple[str, str]]:
        a, b = problem.numbers
        call = f"print({a}*{b})" if self.tool == "python" else f"calc({a}*{b})"
        return [(call, f">{problem.answer}\n"), (problem.answer, "")]

    def respond(self, problem: Problem, turns: list[str]) -> str | None:
        if len(turns) != 1:
            return None
        result = self.run_tool(turns[0])
        if result is None:  # not a tool call: the turn was the final answer
            return None
        return f">{result.output if result.ok else 'error'}\n"

    def run_tool(self, call: str) -> sandbox.ToolResult | None:
        match = _TOOL_CALL.match(call.strip())
        if match is None:
            return None
        name, argument = match.groups()
        if name == "calc":
            result = sandbox.calculator(argument)
            time.sleep(sandbox.service_latency_s(call, self.latency_s))
            return result
        return sandbox.call_service(f"print({argument})", timeout_s=self.timeout_s, latency_s=self.latency_s)

    def reward(self, problem: Problem, turns: list[str]) -> float:
        return float(bool(turns) and turns[-1].strip() == problem.answer)
