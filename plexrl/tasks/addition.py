"""Two-digit addition: prompt `'12+34='`, correct turn `'46'`. One turn, reward 1 or 0."""

from __future__ import annotations

import numpy as np

from plexrl.tasks.base import Problem


class AdditionTask:
    name = "addition"
    max_turns = 1

    def __init__(self, low: int = 10, high: int = 99):
        if not 0 <= low <= high:
            raise ValueError(f"addition operand range low={low}, high={high} (expected 0 <= low <= high)")
        self.low, self.high = low, high

    def sample_problem(self, rng: np.random.Generator) -> Problem:
        a, b = (int(x) for x in rng.integers(self.low, self.high + 1, size=2))
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b), numbers=(a, b), target=a + b)

    def demonstration(self, problem: Problem) -> list[tuple[str, str]]:
        return [(problem.answer, "")]

    def respond(self, problem: Problem, turns: list[str]) -> str | None:
        return None

    def reward(self, problem: Problem, turns: list[str]) -> float:
        return float(len(turns) == 1 and turns[0].strip() == problem.answer)
