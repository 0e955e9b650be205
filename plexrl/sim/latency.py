"""The latency model: how long each function takes, and how big each model state is per GPU.

This replaces execution, and only execution: every scheduling decision still comes from
`plexrl/policy/`. A *worker* is one GPU. A rollout request runs on one model replica (`tp`
GPUs of one node); log-probs, the training update and weight sync are collectives over all of
the job's training GPUs (ZeRO-3), one gang request each.

Decode (continuous batching, memory-bound; `plexrl.policy.DecodeModel`, the function the
runtime's scheduler estimates batched sample calls with and `plexrl sim calibrate` fits from a
run's `batch` events): one decode step of a replica over `b` live sequences costs `t0 + c*b`, where `t0` reads every weight once (weight bytes / (tp * HBM
bandwidth)) and `c` is the per-sequence compute and KV traffic. A replica whose responses have
lengths `L_i` therefore takes `t0 * max(L) + c * sum(L)`: it ends when its longest response ends
(the long tail), and per-GPU throughput `b / (t0 + c b)` rises with the per-replica batch, so
small data-parallel sizes decode more per GPU (the paper's Fig. 7c). Each replica is its own
request, so a replica that finishes early gives its GPUs back at once.
Prefill-like work (log-probs) and training cost FLOPs: `2 * active params` per token forward,
`UPDATE_VS_FORWARD` times that for forward+backward+optimizer, in GPU-seconds per token, spread
over the job's training GPUs.

Calibration (H20: 2.8 TB/s and 84 TFLOP/s effective, `DECODE_SEQ_FACTOR` 2.5): Qwen2.5-7B, 2,048
responses on 32 GPUs gives generation ~375 s and old log-prob ~108 s against the published
357 s / 108 s; update/log-prob 2.5 matches 270 s / 108 s. Checked in tests/test_sim_latency.py.

Long-tail consolidation (PlexRL only; the paper's small data-parallel size for long-tail shards,
as RLHFuse migrates the tail): once at most `tail_capacity` responses are still decoding, the
survivors move to `TAIL_REPLICAS` replicas, re-prefill their prompt and tokens so far there, and
finish at a batch that keeps each decode step within `TAIL_STEP_GROWTH` of a lone sequence's;
the job's other replicas' GPUs are free for other jobs instead of idling through the tail. The
cut is a fixed decode step `K` for every replica (a synchronous hand-off).

State sizes per GPU: sampler = its replica's share of the bf16 weights (2 B/param / tp) plus a
KV reserve; ref = the same weights without KV; trainer = full training state (16 B/param: bf16
weights and grads, fp32 master and Adam moments) sharded over the job's training GPUs (ZeRO-3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from plexrl.policy import DecodeModel
from plexrl.sim.workload import GB, WorkloadJob, RolloutShape, SimCluster

BYTES_PER_WEIGHT = 2
BYTES_PER_TRAIN_PARAM = 16
DECODE_SEQ_FACTOR = 2.5  # attention + KV reads + sampling on top of the matmul FLOPs of one token
UPDATE_VS_FORWARD = 2.5  # forward+backward+optimizer / forward (published 7B breakdown: 270 s / 108 s)
# Published weight-sync times (params in billions -> seconds): 7B 0.1 s, 30B 4-16 s, 235B 24-59 s.
WEIGHT_SYNC_POINTS = ((7.0, 0.1), (30.0, 8.0), (235.0, 40.0))
TAIL_STEP_GROWTH = 0.25  # a tail replica's batch may make a decode step at most 25% slower than t0
TAIL_REPLICAS = 2  # replicas that finish a consolidated tail


@dataclass(frozen=True)
class JobCosts:
    """Costs of one job on one device type; bytes are per GPU."""

    decode_step_s: float  # t0, one replica
    decode_seq_s: float  # c, one replica
    forward_token_s: float  # GPU-seconds per token
    update_token_s: float  # GPU-seconds per token
    weight_sync_s: float
    prefill_token_s: float  # one replica's prompt processing per token (tail re-prefill)
    sampler_bytes: int  # weights + KV reserve
    ref_bytes: int  # weights only
    trainer_bytes: int
    gpu_bytes: int  # arena capacity of one GPU

    @cached_property
    def decode(self) -> DecodeModel:
        """One replica's decode model (prompts are not in it: a tail's re-prefill is costed apart)."""
        return DecodeModel(self.decode_step_s, self.decode_seq_s)

    def decode_s(self, longest: float, total: float) -> float:
        return self.decode.seconds(longest, total)

    @property
    def tail_batch(self) -> int:
        """Sequences one tail replica decodes while a step costs at most (1 + growth) * t0."""
        return max(1, int(TAIL_STEP_GROWTH * self.decode_step_s / self.decode_seq_s))


def weight_sync_s(params_b: float) -> float:
    """Log-log interpolation through the published points, clamped at the ends."""
    pts = WEIGHT_SYNC_POINTS
    if params_b <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if params_b <= x1:
            f = math.log(params_b / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + f * math.log(y1 / y0))
    return pts[-1][1]


def gpu_arena_bytes(cluster: SimCluster) -> int:
    dev = cluster.device
    return int(dev.memory_gb * GB * dev.usable_fraction)


def job_costs(job: WorkloadJob, cluster: SimCluster, train_gpus: int | None = None) -> JobCosts:
    """Costs of `job` on `cluster`; the training state is sharded over `train_gpus` GPUs
    (default: all the job's GPUs)."""
    dev = cluster.device
    forward_token_s = 2 * job.active_b * 1e9 / (dev.tflops * 1e12)
    gpu_bytes = gpu_arena_bytes(cluster)
    weights = int(BYTES_PER_WEIGHT * job.params_b * 1e9)
    replica_token_s = 2 * job.active_b * 1e9 / (dev.tflops * 1e12 * job.tp)
    return JobCosts(
        decode_step_s=weights / (dev.hbm_tb_s * 1e12 * job.tp),
        decode_seq_s=DECODE_SEQ_FACTOR * replica_token_s,
        forward_token_s=forward_token_s,
        prefill_token_s=replica_token_s,
        update_token_s=UPDATE_VS_FORWARD * forward_token_s,
        weight_sync_s=job.weight_sync_s if job.weight_sync_s is not None else weight_sync_s(job.params_b),
        sampler_bytes=weights // job.tp + int(job.kv_cache_fraction * gpu_bytes),
        ref_bytes=weights // job.tp,
        trainer_bytes=int(BYTES_PER_TRAIN_PARAM * job.params_b * 1e9 / (train_gpus or job.gpus)),
        gpu_bytes=gpu_bytes,
    )


def sample_lengths(rollout: RolloutShape, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` response lengths from the Gaussian mixture, clipped to [1, max_tokens]."""
    cumulative = np.cumsum(rollout.length_weights)
    u = rng.random(n)
    # the component index is how many cumulative weights u has passed; one comparison per
    # component (a handful) is ~8x faster than searchsorted over tens of thousands of draws
    component = np.zeros(n, dtype=np.intp)
    for edge in cumulative[:-1]:
        component += u >= edge
    means = np.asarray(rollout.length_means) * rollout.length_scale
    stds = np.asarray(rollout.length_stds) * rollout.length_scale
    # in place, in the order of `means + stds * z` (the same floats): tens of thousands of draws
    # per block, so each temporary array saved is visible
    lengths = stds.take(component)
    lengths *= rng.standard_normal(n)
    lengths += means.take(component)
    np.rint(lengths, out=lengths)
    return np.clip(lengths, 1, rollout.max_tokens, out=lengths)


def decode_shards(costs: JobCosts, lengths: np.ndarray, replicas: int) -> tuple[float, ...]:
    """Seconds each of `replicas` spends decoding its share of `lengths`: even blocks in order,
    the remainder (< replicas) one each to the first replicas."""
    return tuple(decode_rows(costs, lengths[None, :], replicas)[0].tolist())


def decode_rows(costs: JobCosts, lengths: np.ndarray, replicas: int) -> np.ndarray:
    """`decode_shards` of each row of `lengths` (rows: steps of one job, all the same size),
    shape (rows, replicas): one pass of numpy calls for a block of steps, the same floats as
    row by row (each row's sums reduce the same contiguous runs)."""
    rows, size = lengths.shape
    n = size - size % replicas
    head = lengths[:, :n].reshape(rows, replicas, -1)
    longest, total = head.max(axis=2, initial=0.0), head.sum(axis=2)
    if n < size:  # skipped when the block divides evenly: a few numpy calls per phase saved
        rest = lengths[:, n:]
        k = size - n
        longest[:, :k] = np.maximum(longest[:, :k], rest)
        total[:, :k] += rest
    return costs.decode.seconds(longest, total)


def tail_cut(lengths: np.ndarray, capacity: int) -> float | None:
    """The decode step `K` after which at most `capacity` responses are still running (those
    longer than K), or None when all of them fit the tail already (nothing to consolidate)."""
    cuts = tail_cuts(lengths[None, :], capacity)
    return None if cuts is None else float(cuts[0])


def tail_cuts(lengths: np.ndarray, capacity: int) -> np.ndarray | None:
    """`tail_cut` of each row of `lengths` (rows all the same size)."""
    size = lengths.shape[1]
    if size <= capacity:
        return None
    return np.partition(lengths, size - capacity - 1, axis=1)[:, size - capacity - 1]


Split = tuple[tuple[float, ...], tuple[float, ...]]


def consolidated_shards(
    costs: JobCosts, lengths: np.ndarray, replicas: int, prompt_tokens: int, tail_replicas: int | None = None
) -> Split | None:
    """(main seconds per replica, tail seconds per tail replica) with the long tail consolidated
    onto `tail_replicas` replicas, or None when that frees nothing (no more replicas than the
    tail needs, or a rollout that fits the tail)."""
    return consolidated_rows(costs, lengths[None, :], replicas, prompt_tokens, tail_replicas)[0]


def consolidated_rows(
    costs: JobCosts, lengths: np.ndarray, replicas: int, prompt_tokens: int, tail_replicas: int | None = None
) -> list[Split | None]:
    """`consolidated_shards` of each row of `lengths` (a block of steps), the same floats."""
    tail_replicas = tail_replicas or TAIL_REPLICAS
    rows = len(lengths)
    cuts = tail_cuts(lengths, costs.tail_batch * tail_replicas) if replicas > tail_replicas else None
    if cuts is None:
        return [None] * rows
    main = decode_rows(costs, np.minimum(lengths, cuts[:, None]), replicas)
    above = lengths > cuts[:, None]
    survivors = above.sum(axis=1)
    reprefill = costs.prefill_token_s * (prompt_tokens + cuts)
    tails: list[np.ndarray | None] = [None] * rows
    for count in np.unique(survivors[cuts > 0]).tolist():  # rows with as many survivors: one pass
        same = np.flatnonzero((survivors == count) & (cuts > 0))
        rest = (lengths[same][above[same]].reshape(len(same), count) - cuts[same, None])
        dealt = np.full(tail_replicas, count // tail_replicas)  # responses per tail replica, round-robin
        dealt[: count % tail_replicas] += 1
        tail = decode_rows(costs, rest, tail_replicas) + reprefill[same, None] * dealt
        for i, row in zip(same.tolist(), tail):
            tails[i] = row
    return [None if tails[i] is None else (tuple(main[i].tolist()), tuple(tails[i].tolist())) for i in range(rows)]
