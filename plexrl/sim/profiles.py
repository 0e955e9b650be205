"""A job's demand profile for the placer, computed from the plan of its first step.

The profile is the one a job brings with it (docs/design.md §6: "profiled from its first steps or
given"): how many of its GPUs are busy over one solo step, with every state resident, in
`SLOTS` equal slots, the bytes each of its states needs per GPU, and the moments of its calls
that the placer's co-tenancy model reads (`call_moments`).
"""

from __future__ import annotations

import numpy as np

from plexrl.policy.profile import JobProfile, ModelMemory
from plexrl.sim.latency import JobCosts
from plexrl.sim.phases import Phase, StepPlans, first_step, plan_step, states_of
from plexrl.sim.workload import WorkloadJob

SLOTS = 64


def busy_intervals(phases: list[Phase]) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(starts, ends, GPUs, step length) of every shard of a solo step; phases run back to back."""
    starts, ends, gpus, t = [], [], [], 0.0
    for p in phases:
        if p.state is None:
            t += p.idle_s
            continue
        starts += [t] * len(p.shard_s)
        ends += [t + s for s in p.shard_s]
        gpus += [p.shard_gpus] * len(p.shard_s)
        t += max(p.shard_s)
    return np.array(starts), np.array(ends), np.array(gpus, dtype=float), t


def demand_per_slot(phases: list[Phase], slots: int = SLOTS) -> tuple[np.ndarray, float]:
    """(busy GPUs per slot, step period): exact averages of the busy intervals per slot."""
    starts, ends, gpus, period = busy_intervals(phases)
    edges = np.linspace(0.0, period, slots + 1)
    busy_before = (np.clip(edges[:, None] - starts[None, :], 0.0, (ends - starts)[None, :]) * gpus[None, :]).sum(axis=1)
    return np.diff(busy_before) / np.diff(edges), period


def state_bytes(job: WorkloadJob, costs: JobCosts) -> dict[str, int]:
    sizes = {"sampler": costs.sampler_bytes, "ref": costs.ref_bytes, "trainer": costs.trainer_bytes}
    return {s: sizes[s] for s in states_of(job)}


def model_memory(job: WorkloadJob, costs: JobCosts) -> tuple[ModelMemory, ...]:
    """What the placer counts of each state: the sampler's host copy is its trainer's weights
    (not stored twice); a reference of a named base checkpoint (`WorkloadJob.base`) is one shared
    copy of the weights per node, for every job of that base there."""
    models = []
    for name, nbytes in state_bytes(job, costs).items():
        if name == "sampler":
            models.append(ModelMemory(name, nbytes, 0))
        elif name == "ref" and job.base:
            models.append(ModelMemory(name, nbytes, nbytes * job.tp, shared=f"{job.base}/ref"))
        else:
            models.append(ModelMemory(name, nbytes, nbytes))
    return tuple(models)


def job_profile(job: WorkloadJob, costs: JobCosts, seed: int, index: int, consolidate_tail: bool = False,
                plans: StepPlans | None = None, elastic: bool = False) -> JobProfile:
    """`plans`, when given, supplies the first step (the same phases, planned once for every mode).
    `elastic`: its rollouts are elastic when it shares (`sim/rollout.py`), so the profile says
    which of its calls are rollouts (`call_moments`)."""
    if plans is not None:
        phases = plans.step(job, seed, index, costs, 0, job.gpus, job.gpus, consolidate_tail)
    else:
        phases = plan_step(job, costs, first_step(job, seed, index), job.gpus, job.gpus, consolidate_tail)
    demand, period = demand_per_slot(phases)
    models = model_memory(job, costs)
    moments = call_moments(phases, period, elastic and consolidate_tail)
    return JobProfile(job.name, period, tuple(np.minimum(demand, job.gpus)), job.gpus, models, job.slack,
                      replica_devices=job.tp, ends=True, steps=job.steps, **moments)


def call_moments(phases: list[Phase], period: float, elastic: bool = False) -> dict:
    """What the placer's co-tenancy model reads of a job's calls (`JobProfile.barriers`,
    `residual_s`): its device phases per step, and the sum of their seconds^2 / (2 period). A
    phase lasts until its slowest call ends: a co-tenant's phase that needs those devices (all
    of them, as a barrier) waits for that one. `elastic` (its rollouts are): a rollout turn is
    one barrier (its consolidated tail goes on from its cut without waiting), and the rollouts'
    part of those figures and their seconds on all replicas (`rollout_barriers`,
    `rollout_residual_s`, `rollout_s`) are given too."""
    device = [(p.fn, max(p.shard_s)) for p in phases if p.state is not None]  # each phase lasts its slowest call
    residual = lambda squares: squares / (2 * period) if period > 0 else 0.0
    moments = {"barriers": len(device), "residual_s": residual(sum(s ** 2 for _, s in device))}
    if elastic:
        turns = [s for fn, s in device if fn == "sample"]
        moments["barriers"] -= sum(1 for fn, _ in device if fn == "sample_tail")
        moments["rollout_barriers"] = len(turns)
        moments["rollout_residual_s"] = min(moments["residual_s"], residual(
            sum(s ** 2 for fn, s in device if fn in ("sample", "sample_tail"))))
        moments["rollout_s"] = min(period, sum(turns))
    return moments
