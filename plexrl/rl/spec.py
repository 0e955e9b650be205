"""What a job is, as a user writes it: validated at the edge with pydantic (STYLE 6, 12).

A `JobSpec` names the task, the algorithm, the model to start from and the hyper-parameters.
Defaults are the ones the demo uses; every field rejects values that cannot work, and
`describe_errors` turns pydantic's report into lines naming field, value and expectation.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ALGORITHMS = ("grpo", "ppo", "reinforce_pp", "dapo", "distill")
GROUP_ALGORITHMS = ("grpo", "dapo")


class ModelSpec(BaseModel):
    """A tiny char-level Llama built offline and warmed up with SFT on the job's task."""

    model_config = ConfigDict(extra="forbid")
    hidden_size: int = Field(64, ge=8, le=1024, description="hidden size")
    num_layers: int = Field(2, ge=1, le=16, description="transformer layers")
    num_heads: int = Field(4, ge=1, le=32, description="attention heads")
    seed: int = Field(0, ge=0, description="initialisation seed")
    warm_start_steps: int | None = Field(None, ge=0, le=100_000,
                                         description="SFT steps on the task format (None: the task's default)")

    @model_validator(mode="after")
    def heads_divide_hidden(self) -> "ModelSpec":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
        return self


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="job name")
    algorithm: Literal["grpo", "ppo", "reinforce_pp", "dapo", "distill"]
    task: Literal["addition", "countdown", "tool_use"]
    steps: int = Field(ge=1, le=100_000)
    seed: int = Field(0, ge=0)
    model: ModelSpec = Field(default_factory=ModelSpec)
    problems_per_step: int = Field(4, ge=1, le=1024)
    group_size: int = Field(4, ge=1, le=256)
    learning_rate: float = Field(1e-3, gt=0, le=1.0)
    max_tokens: int = Field(8, ge=1, le=128)
    temperature: float = Field(1.0, gt=0, le=10.0)
    kl_coef: float = Field(0.0, ge=0, description="weight of the token-level KL to the reference")
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    clip_low: float = Field(0.8, ge=0, le=1.0)
    clip_high: float = Field(1.2, ge=1.0, le=10.0)
    gamma: float = Field(1.0, ge=0, le=1.0)
    lam: float = Field(0.95, ge=0, le=1.0)
    critic_learning_rate: float = Field(3e-3, gt=0, le=1.0)
    max_sampling_rounds: int = Field(3, ge=1, le=64, description="DAPO: rounds to refill flat groups")
    teacher_warm_start_steps: int = Field(1000, ge=0, le=100_000, description="distill: SFT steps of the teacher")
    slack: float = Field(0.10, ge=0, le=100.0, description="the job's SLO: how much slower than alone its steps "
                                                         "may run when it shares devices (0.1 = 10%)")

    @model_validator(mode="after")
    def groups_need_two(self) -> "JobSpec":
        if self.algorithm in GROUP_ALGORITHMS and self.group_size < 2:
            raise ValueError(f"group_size={self.group_size} for {self.algorithm} "
                             "(expected >= 2: advantages are relative to the group)")
        return self


def describe_errors(error: ValidationError, where: str = "") -> list[str]:
    """One line per problem: `where.field = VALUE: expected WHAT` (no traceback, no pydantic jargon)."""
    return [_describe(problem, where) for problem in error.errors()]


_PHRASES = (("Input should be ", ""), ("String should ", "a string that should "), ("List should have ", "a list with "),
            ("Input should ", ""), ("Value error, ", ""))


def _describe(problem: dict, where: str) -> str:
    path = where
    for part in problem["loc"]:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    path = path or "(top level)"
    message = problem["msg"]
    for phrase, replacement in _PHRASES:
        message = message.replace(phrase, replacement, 1) if message.startswith(phrase) else message
    if problem["type"] == "missing":
        return f"{path}: missing; expected a value"
    if problem["type"] == "extra_forbidden":
        return f"{path} = {problem['input']!r}: expected no such field (a typo?)"
    if problem["type"] == "value_error":
        return f"{path}: {message}"
    return f"{path} = {problem['input']!r}: expected {message}"
