"""Tasks with verifiable rewards: two-digit addition, countdown, and an agentic tool task.

`make_task(name, **options)` builds one; `TASKS` lists the names.
"""

from __future__ import annotations

from plexrl.tasks.addition import AdditionTask
from plexrl.tasks.base import TURN_END, Problem, Task, demonstration_text
from plexrl.tasks.countdown import CountdownTask
from plexrl.tasks.tool_use import ToolUseTask

TASKS = {"addition": AdditionTask, "countdown": CountdownTask, "tool_use": ToolUseTask}


def make_task(name: str, **options) -> Task:
    if name not in TASKS:
        raise ValueError(f"task {name!r} is unknown (expected one of {sorted(TASKS)})")
    return TASKS[name](**options)


__all__ = ["TASKS", "TURN_END", "AdditionTask", "CountdownTask", "Problem", "Task", "ToolUseTask",
           "demonstration_text", "make_task"]
