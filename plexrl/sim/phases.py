"""What one RLVR step asks of the devices: an ordered list of phases, drawn once per step.

A step of GRPO/DAPO, as its controller issues it:
  1) rollout: `turns` sample calls per shard, separated by device-idle tool waits (agentic);
     DAPO's dynamic sampling adds a refill rollout for a share of the prompts;
  2) reward / sandbox: device-idle;
  3) old-policy log-probs; 4) reference log-probs (GRPO only: DAPO drops KL);
  5) training update on the trainer state; 6) weight sync (trainer -> sampler weights).
Old log-probs run on the trainer state, as verl's actor computes them; the sampler state is
only used for generation, so split mode can keep it alone on the rollout pool.
Device phases carry one duration per shard and the GPUs each shard needs at once (its gang):
a sample phase has one shard per replica (`tp` GPUs), the other phases one shard over all
the state's GPUs (a collective). The phase ends when every shard has finished. Idle phases
carry one duration. With the long tail consolidated (PlexRL), each sample phase is followed
by a `sample_tail` phase of `TAIL_REPLICAS` replica shards (`latency.consolidated_shards`).

Invariant: the draws depend only on (seed, job index) and the step order, never on the mode
simulated, so colocated, split and PlexRL runs see the same response lengths and tool waits.
Each job draws from its own generator (`job_rng`) in blocks of `draw_block(job)` steps, one
numpy call per quantity per block (the block size depends only on the job, so every mode and
the placer's profile see the same stream).
Because a step's phases are a pure function of (seed, job, step, costs, GPU shape, tail
consolidation), the modes of one `simulate` call share them through `StepPlans`: a mode that
plans a step the same way as an earlier mode reuses that plan (the same Phase objects) instead
of drawing and planning it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from plexrl.sim.latency import JobCosts, consolidated_rows, decode_rows, sample_lengths
from plexrl.sim.workload import WorkloadJob

SAMPLER, REF, TRAINER = "sampler", "ref", "trainer"
MAIN, REFILL = 0, 1  # `Phase.part`: a sample phase decodes the step's responses (per turn), or its refill


class Phase(NamedTuple):  # immutable; a tuple because every step of every job builds ~15 of them
    fn: str  # sample | logprobs | ref_logprobs | update | sync | tools | reward
    state: str | None  # the model state it runs on; None for device-idle phases
    shard_s: tuple[float, ...] = ()  # device phases: seconds per shard
    idle_s: float = 0.0  # idle phases
    shard_gpus: int = 1  # GPUs each shard occupies together (a replica, or all the state's GPUs)
    part: int = -1  # sample phases: whose lengths they decode, the step's responses (0) or its refill (1)


def states_of(job: WorkloadJob) -> tuple[str, ...]:
    return (SAMPLER, REF, TRAINER) if job.algorithm == "grpo" else (SAMPLER, TRAINER)


DRAW_BLOCK = 32  # steps drawn per numpy call: amortises the per-call overhead of the samplers


def job_rng(seed: int, job_index: int) -> np.random.Generator:
    return np.random.default_rng((seed, job_index))


@dataclass(frozen=True)
class StepDraws:
    """Every random quantity of one step."""

    lengths: np.ndarray  # response lengths, tokens
    tool_waits: np.ndarray  # one per turn, seconds
    refill: np.ndarray | None  # DAPO refill response lengths
    reward_factor: float  # multiplies the job's reward_s


def draw_block(job: WorkloadJob) -> int:
    return min(DRAW_BLOCK, job.steps)


@dataclass(frozen=True)
class DrawBlock:
    """Every random quantity of consecutive steps of one job, one row per step."""

    lengths: np.ndarray  # (steps, responses), tokens
    tool_waits: np.ndarray  # (steps, turns), seconds
    refill: np.ndarray | None  # (steps, refill responses)
    reward_factor: tuple[float, ...]  # one per step

    def __len__(self) -> int:
        return len(self.lengths)

    def step(self, i: int) -> StepDraws:
        return StepDraws(self.lengths[i], self.tool_waits[i], None if self.refill is None else self.refill[i],
                         self.reward_factor[i])

    def rows(self, first: int, last: int, lengths_type: type | None = None) -> DrawBlock:
        """Steps [first, last) of the block, with the lengths (and refills) as `lengths_type`
        (a copy) when given."""
        lengths, refill = self.lengths[first:last], None if self.refill is None else self.refill[first:last]
        if lengths_type is not None:
            lengths = lengths.astype(lengths_type)
            refill = None if refill is None else refill.astype(lengths_type)
        return DrawBlock(lengths, self.tool_waits[first:last], refill, self.reward_factor[first:last])

    @staticmethod
    def of(steps: list[StepDraws]) -> DrawBlock:
        refill = None if steps[0].refill is None else np.stack([d.refill for d in steps])
        return DrawBlock(np.stack([d.lengths for d in steps]), np.stack([d.tool_waits for d in steps]), refill,
                         tuple(d.reward_factor for d in steps))


def draw_rows(job: WorkloadJob, rng: np.random.Generator) -> DrawBlock:
    """The draws of the job's next `draw_block(job)` steps."""
    r, k = job.rollout, draw_block(job)
    lengths = sample_lengths(r, k * r.responses, rng).reshape(k, r.responses)
    tools = rng.lognormal(0.0, 0.25, size=(k, r.turns)) * r.tool_s
    refills = None
    if r.refill_fraction > 0:
        m = max(1, round(r.refill_fraction * r.responses))
        refills = sample_lengths(r, k * m, rng).reshape(k, m)
    reward = rng.lognormal(0.0, 0.1, size=k)
    return DrawBlock(lengths, tools, refills, tuple(reward.tolist()))


def draw_steps(job: WorkloadJob, rng: np.random.Generator) -> list[StepDraws]:
    """`draw_rows`, step by step."""
    block = draw_rows(job, rng)
    return [block.step(i) for i in range(len(block))]


def first_step(job: WorkloadJob, seed: int, job_index: int) -> StepDraws:
    return draw_steps(job, job_rng(seed, job_index))[0]


def plan_step(
    job: WorkloadJob,
    costs: JobCosts,
    draws: StepDraws,
    rollout_gpus: int,
    train_gpus: int,
    consolidate_tail: bool = False,
) -> list[Phase]:
    """The phases of one step; `rollout_gpus` GPUs sample (as replicas of `tp`), `train_gpus`
    GPUs compute log-probs and train."""
    return plan_steps(job, costs, DrawBlock.of([draws]), rollout_gpus, train_gpus, consolidate_tail)[0]


def plan_steps(
    job: WorkloadJob,
    costs: JobCosts,
    draws: DrawBlock,
    rollout_gpus: int,
    train_gpus: int,
    consolidate_tail: bool = False,
) -> list[list[Phase]]:
    """`plan_step` of each step of a block, with one pass of numpy calls per quantity for the
    whole block (the same floats as step by step: tested). Lengths must be float64."""
    r = job.rollout
    shape = (costs, rollout_gpus // job.tp, job.tp, r.prompt_tokens if consolidate_tail else None)
    rollouts = _rollout(draws.lengths, r.turns, draws.tool_waits, *shape, MAIN)
    if draws.refill is not None:
        refills = _rollout(draws.refill, 1, draws.tool_waits, *shape, REFILL)
    else:
        refills = [[] for _ in range(len(draws))]
    tokens = (draws.lengths.sum(axis=1) + r.responses * r.prompt_tokens).tolist()
    collective = lambda fn, state, s: Phase(fn, state, (s,), shard_gpus=train_gpus)
    steps = []
    for reward, rollout, refill, step_tokens in zip(draws.reward_factor, rollouts, refills, tokens):
        phases = rollout + refill
        phases.append(Phase("reward", None, idle_s=job.reward_s * reward))
        forward_s = costs.forward_token_s * step_tokens / train_gpus
        phases.append(collective("logprobs", TRAINER, forward_s))
        if job.algorithm == "grpo":
            phases.append(collective("ref_logprobs", REF, forward_s))
        phases.append(collective("update", TRAINER, costs.update_token_s * step_tokens / train_gpus))
        phases.append(collective("sync", TRAINER, costs.weight_sync_s))
        steps.append(phases)
    return steps


def _rollout(
    lengths: np.ndarray,
    turns: int,
    tool_waits: np.ndarray,
    costs: JobCosts,
    replicas: int,
    tp: int,
    tail_prompt_tokens: int | None,
    part: int,
) -> list[list[Phase]]:
    """Per row of `lengths` (a step), `turns` sample phases separated by tool waits (a row of
    `tool_waits` each); `tail_prompt_tokens` set means consolidate each turn's long tail (its
    tail re-prefills that many prompt tokens per response on top of the decoded ones)."""
    per_turn = lengths if turns == 1 else lengths / turns  # x / 1 is x: no copy
    splits = [None] * len(lengths)
    if tail_prompt_tokens is not None:
        splits = consolidated_rows(costs, per_turn, replicas, tail_prompt_tokens)
    whole = None
    if any(split is None for split in splits):
        whole = decode_rows(costs, per_turn, replicas)
    waits = tool_waits[:, : turns - 1].tolist()
    steps = []
    for i, split in enumerate(splits):
        if split is None:
            turn_phases = [Phase("sample", SAMPLER, tuple(whole[i].tolist()), shard_gpus=tp, part=part)]
        else:
            turn_phases = [Phase("sample", SAMPLER, split[0], shard_gpus=tp, part=part),
                           Phase("sample_tail", SAMPLER, split[1], shard_gpus=tp, part=part)]
        phases = list(turn_phases)
        for wait in waits[i]:
            phases.append(Phase("tools", None, idle_s=wait))
            phases += turn_phases
        steps.append(phases)
    return steps


class StepPlans:
    """Planned steps shared by the modes simulating one workload (one instance per workload
    and seed: the keys hold the job's index and name, not the whole spec). A job's draws are
    made once and kept for every shape that plans its steps; steps are planned a draw block at
    a time (`plan_steps`)."""

    def __init__(self) -> None:
        self._plans: dict[tuple, list[list[Phase]]] = {}
        self._draws: dict[tuple, _JobDraws] = {}

    def step(self, job: WorkloadJob, seed: int, index: int, costs: JobCosts, step: int,
             rollout_gpus: int, train_gpus: int, consolidate_tail: bool) -> list[Phase]:
        """The phases of `job`'s step `step` (0-based), planned as `plan_step` would."""
        key = (seed, index, job.name, costs, rollout_gpus, train_gpus, consolidate_tail)
        steps = self._plans.get(key)
        if steps is None:
            steps = self._plans[key] = []
        while len(steps) <= step:  # plan the rest of the draw block at once (not past the last step)
            first, size = len(steps), draw_block(job)
            b, last = first // size, min((first // size + 1) * size, max(job.steps, first + 1))
            block = self._job_draws(job, seed, index, b).blocks[b]
            steps += plan_steps(job, costs, block.rows(first - b * size, last - b * size, np.float64),
                                rollout_gpus, train_gpus, consolidate_tail)
        return steps[step]

    def draws(self, job: WorkloadJob, seed: int, index: int, step: int) -> StepDraws:
        """What `job` draws for its step `step`: its own generator's blocks, in step order."""
        size = draw_block(job)
        block = self._job_draws(job, seed, index, step // size).blocks[step // size]
        return block.rows(step % size, step % size + 1, np.float64).step(0)

    def _job_draws(self, job: WorkloadJob, seed: int, index: int, block: int) -> _JobDraws:
        """The job's draws, drawn up to block `block` at least."""
        draws = self._draws.get((seed, index, job.name))
        if draws is None:
            draws = self._draws[(seed, index, job.name)] = _JobDraws(job_rng(seed, index), _length_type(job))
        while len(draws.blocks) <= block:
            drawn = draw_rows(job, draws.rng)
            draws.blocks.append(drawn.rows(0, len(drawn), draws.length_type))
        return draws


def part_lengths(job: WorkloadJob, draws: StepDraws, part: int) -> np.ndarray:
    """The lengths a sample phase of `part` decodes in one turn (what `plan_steps` deals)."""
    if part == REFILL:
        return draws.refill
    turns = job.rollout.turns
    return draws.lengths if turns == 1 else draws.lengths / turns


def _length_type(job: WorkloadJob) -> type:
    return np.uint16 if job.rollout.max_tokens <= np.iinfo(np.uint16).max else np.float64


@dataclass
class _JobDraws:
    """A job's draw blocks so far. Response lengths are whole numbers in [1, max_tokens], so
    they are kept as uint16 when that holds them (exactly: as float64 again, they are the drawn
    floats), a quarter of the memory for the blocks every shape reads again."""

    rng: np.random.Generator
    length_type: type
    blocks: list[DrawBlock] = field(default_factory=list)


def gpu_seconds(phases: list[Phase]) -> float:
    """Device time a step occupies when every state is resident: each shard x its gang."""
    return sum(sum(p.shard_s) * p.shard_gpus for p in phases if p.state)


def solo_step_s(phases: list[Phase]) -> float:
    """Step time of a job alone on its workers with every state resident (no switches)."""
    return sum(max(p.shard_s) if p.state else p.idle_s for p in phases)
