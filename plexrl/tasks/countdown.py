"""Countdown: reach a target from given numbers with + - * / (each number used at most once).

Prompt `'3,5,7>22:'`, a correct turn is an expression such as `'3*5+7'`. Reward: 1 for an
expression over a sub-multiset of the numbers whose exact value is the target; `FORMAT_REWARD`
for a valid expression over the numbers with another value (the shaping that lets a small model
climb); 0 for anything else. Targets are built from a random expression over the numbers, so
every problem has a solution, which is also the demonstration.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from plexrl.tasks import arith
from plexrl.tasks.base import Problem

FORMAT_REWARD = 0.1

# How targets are made from the numbers (a, b, c); each is also a correct answer.
_TEMPLATES = ("{a}+{b}", "{a}*{b}", "{a}+{b}+{c}", "{a}*{b}+{c}", "{a}*{b}-{c}", "{a}+{b}-{c}")


class CountdownTask:
    name = "countdown"
    max_turns = 1

    def __init__(self, count: int = 3, high: int = 9):
        if count < 3 or high < 1:
            raise ValueError(f"countdown count={count}, high={high} (expected count >= 3, high >= 1)")
        self.count, self.high = count, high

    def sample_problem(self, rng: np.random.Generator) -> Problem:
        numbers = tuple(int(x) for x in rng.integers(1, self.high + 1, size=self.count))
        template = _TEMPLATES[int(rng.integers(len(_TEMPLATES)))]
        a, b, c = numbers[:3]
        solution = template.format(a=a, b=b, c=c)
        target = int(arith.evaluate(solution))
        prompt = ",".join(map(str, numbers)) + f">{target}:"
        return Problem(prompt=prompt, answer=solution, numbers=numbers, target=target)

    def demonstration(self, problem: Problem) -> list[tuple[str, str]]:
        return [(problem.answer, "")]

    def respond(self, problem: Problem, turns: list[str]) -> str | None:
        return None

    def reward(self, problem: Problem, turns: list[str]) -> float:
        if len(turns) != 1:
            return 0.0
        try:
            value = arith.evaluate(turns[0])
            used = Counter(arith.literals(turns[0]))
        except arith.ArithError:
            return 0.0
        if used - Counter(problem.numbers):
            return 0.0
        return 1.0 if value == problem.target else FORMAT_REWARD
