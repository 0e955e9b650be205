"""What a task with a verifiable reward is, seen from an RL loop.

An episode is text: the problem's `prompt`, then alternating model turns and environment
replies. Every model turn ends with `TURN_END` (the sampler stops there); `respond` is the
environment's reply to the turns so far (`None` ends the episode) and `reward` grades the
finished turns. Tasks are plain Python on the job side: they never see the model or the
cluster, and a reward is always a float in [0, 1] — a malformed answer scores, it never raises.
`respond` is called for several episodes at once, from several threads (an agentic controller's
tool calls of one turn go out together: `rl.rollout.replies`), so it keeps no state of its own.
`demonstration` is a correct episode as (model turn, environment reply) pairs, the warm-start
(SFT) target; the replies are written out so that building SFT data runs no tools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

TURN_END = "\n"


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # the verified final answer, shown in logs
    numbers: tuple[int, ...] = ()
    target: int = 0


class Task(Protocol):
    name: str
    max_turns: int

    def sample_problem(self, rng: np.random.Generator) -> Problem: ...

    def demonstration(self, problem: Problem) -> list[tuple[str, str]]: ...

    def respond(self, problem: Problem, turns: list[str]) -> str | None: ...

    def reward(self, problem: Problem, turns: list[str]) -> float: ...


def demonstration_text(task: Task, problem: Problem) -> tuple[str, str]:
    """(prompt, everything after it) of a correct episode: the SFT pair."""
    return problem.prompt, "".join(turn + TURN_END + reply for turn, reply in task.demonstration(problem))
