"""Verifiers on named good and bad answers; problems are solvable; demonstrations score 1."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from plexrl.tasks import TURN_END, AdditionTask, CountdownTask, Problem, ToolUseTask, make_task
from plexrl.tasks import arith
from plexrl.tasks.countdown import FORMAT_REWARD

ADDITION = Problem(prompt="12+34=", answer="46", numbers=(12, 34), target=46)
COUNTDOWN = Problem(prompt="3,5,7>22:", answer="3*5+7", numbers=(3, 5, 7), target=22)
TOOL = Problem(prompt="23*47?", answer="1081", numbers=(23, 47), target=1081)


@pytest.mark.parametrize("turns, expected", [
    (["46"], 1.0),
    ([" 46 "], 1.0),
    (["47"], 0.0),
    (["046x"], 0.0),
    ([""], 0.0),
    ([], 0.0),
    (["46", "46"], 0.0),
], ids=["right", "right-padded", "off-by-one", "garbage", "empty-turn", "no-turn", "two-turns"])
def test_addition_verifier(turns, expected):
    assert AdditionTask().reward(ADDITION, turns) == expected


@pytest.mark.parametrize("answer, expected", [
    ("3*5+7", 1.0),
    ("7+3*5", 1.0),
    ("(7+15/5)*3-8", 0.0),          # uses 15 and 8, not given
    ("5*3+7", 1.0),
    ("3*5*7", FORMAT_REWARD),       # valid, wrong value
    ("3+3+7", 0.0),                 # 3 used twice, given once
    ("22", 0.0),                    # a number that was not given
    ("3*5+", 0.0),                  # syntax error
    ("__import__('os')", 0.0),      # not arithmetic
    ("7/0", 0.0),                   # division by zero
    ("(5-3)*7+7", 0.0),             # 7 twice
    ("5*7-3-7", 0.0),
], ids=["template", "reordered", "foreign-numbers", "commuted", "wrong-value", "reused-number",
        "bare-target", "syntax", "code", "div-zero", "reused-7", "reused-7-again"])
def test_countdown_verifier(answer, expected):
    assert CountdownTask().reward(COUNTDOWN, [answer]) == expected


def test_countdown_fractional_intermediates_count_exactly():
    problem = Problem(prompt="", answer="", numbers=(6, 4, 2), target=3)
    assert CountdownTask().reward(problem, ["6/4*2"]) == 1.0


@pytest.mark.parametrize("turns, expected", [
    (["print(23*47)", "1081"], 1.0),
    (["calc(23*47)", "1081"], 1.0),
    (["1081"], 1.0),
    (["print(23*47)", "1080"], 0.0),
    (["print(23*47)", ""], 0.0),
    (["print(23*47)"], 0.0),
], ids=["python-then-answer", "calc-then-answer", "direct", "wrong-copy", "empty", "no-answer"])
def test_tool_use_verifier(turns, expected):
    assert ToolUseTask().reward(TOOL, turns) == expected


@pytest.mark.parametrize("call, reply", [
    ("print(23*47)", ">1081\n"),
    ("calc(23*47)", ">1081\n"),
    ("calc(1/0)", ">error\n"),
    ("print(1/0)", ">error\n"),
    ("print(23*47", None),         # not a tool call: the episode ends, the turn is graded
    ("1081", None),
], ids=["python", "calculator", "calc-crash", "python-crash", "malformed", "direct-answer"])
def test_tool_use_environment_replies(call, reply):
    assert ToolUseTask().respond(TOOL, [call]) == reply


def test_tool_timeout_scores_zero_and_returns():
    task = ToolUseTask(timeout_s=0.5)
    reply = task.respond(TOOL, ["print([0 for _ in iter(int, 1)])"])  # an endless loop
    assert reply == ">error\n"
    assert task.reward(TOOL, ["print([0 for _ in iter(int, 1)])", "error"]) == 0.0


@pytest.mark.parametrize("name", ["addition", "countdown", "tool_use"])
def test_demonstrations_are_correct_and_match_the_environment(name):
    task, rng = make_task(name), np.random.default_rng(0)
    for _ in range(20):
        problem = task.sample_problem(rng)
        pairs = task.demonstration(problem)
        turns = [turn for turn, _ in pairs]
        assert task.reward(problem, turns) == 1.0, (problem, turns)
        for index, (_, reply) in enumerate(pairs):
            assert (task.respond(problem, turns[: index + 1]) or "") == reply
        assert all(TURN_END not in turn for turn in turns)


def test_problems_are_deterministic_in_the_generator():
    for name in ("addition", "countdown", "tool_use"):
        first = [make_task(name).sample_problem(np.random.default_rng(5)) for _ in range(2)]
        assert first[0] == first[1]


@pytest.mark.parametrize("bad", [dict(name="chess"), dict(name="tool_use", tool="shell"),
                                 dict(name="addition", low=50, high=10),
                                 dict(name="tool_use", latency_s=-1.0)])
def test_bad_task_options_name_the_value(bad):
    name = bad.pop("name")
    with pytest.raises(ValueError, match="expected"):
        make_task(name, **bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 99), min_size=1, max_size=4), st.lists(st.sampled_from("+-*"), min_size=3, max_size=3))
def test_arith_matches_python_on_integer_expressions(numbers, ops):
    text = str(numbers[0]) + "".join(op + str(n) for op, n in zip(ops, numbers[1:]))
    assert arith.evaluate(text) == Fraction(eval(text))  # the reference: Python's own integers
    assert arith.literals(text) == numbers


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_countdown_never_raises_on_any_text(text):
    assert CountdownTask().reward(COUNTDOWN, [text]) in (0.0, FORMAT_REWARD, 1.0)
