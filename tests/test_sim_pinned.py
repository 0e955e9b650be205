"""Whole runs pinned bit for bit: a speed change to the simulator must leave every figure of a
small contended workload exactly as it was, in every mode.

The pinned tuples are (events, sum of step times, sum of charges, switch GPU-s, busy GPU-s),
each sum taken in record order, compared with `==` (floats printed with `repr`, which
round-trips exactly). A deliberate change of behaviour (a new policy, a new latency model)
updates them in the same commit and says why; a speed-up never does.
Updated for issue 11: the placer's co-tenancy model (`placement.cotenancy.wait_inflation`) and the closed
loop (`Placer.observe`) change which jobs share GPUs and when they are admitted; then
`wait_inflation` counting a co-tenant whole on any shared device (a barrier waits for its
last call), which changes the placer's predictions and so the PlexRL modes' placements.
Then a job consolidates its rollouts' tails only while it shares its GPUs (`plexrl_mode.Tail`):
every PlexRL mode but `plexrl-wholetail` changed, and `plexrl-alltail` (every job consolidates,
as all of them did before) reproduces the previous `plexrl` figures exactly. Then elastic
rollouts (`sim/rollout.py`): a shared job's rollout decodes on whichever replicas it may use;
every PlexRL mode whose jobs share changed (`plexrl-wholetail` consolidates nothing, so it
shares no rollout out and is unchanged), and `plexrl-pinned` reproduces the previous `plexrl`
figures exactly. Then loads and offloads copy what they would: a sampler's load its weights, not
its KV reserve, and an offload of a read-only state (a sampler, a reference model) nothing: every
mode that switches changed, the baselines too. Then the co-tenancy model knows elastic
rollouts (`placement.cotenancy.wait_s`: a rollout turn shares a co-tenant's rollout's replicas instead of
waiting for it): it predicts less for the jobs of modes whose rollouts are elastic, so they
share GPUs more; `plexrl-pinned` and `plexrl-wholetail` (no elastic rollouts) are unchanged.
Then moves at step boundaries within a node group (a job alone on its GPUs moves into a share
when that lets a waiting job start; a job that shares moves onto unused GPUs while none waits):
`plexrl-noshift` and `plexrl-pinned` move one job each and changed; the others move none.
Then a job alone on its GPUs consolidates its rollouts' tails while nobody waits, when that saves
more GPU-seconds than its slower step holds longer, within its slack (`plexrl_mode.tail_pays`,
#53): of these jobs only `code` qualifies, and in most modes it is never alone while nobody
waits; `plexrl-pinned` and the fixed-limit run below changed.
The workload is
pinned with `pack_limit: null, pack_by_effect: false` (each job judged by its own slack alone,
1.0), so its jobs share GPUs and every contended path runs; the fixed limit `PACKING_PAYS` shares
no GPU here: every job queues for its own, and its step times sum to colocated's but for the
code job's tails, consolidated alone once nobody waits (slower steps for fewer GPU-seconds). The default (packing by
effect, placement/judgement.py) has figures of its own (`PINNED_BY_EFFECT`).
"""

from __future__ import annotations

import numpy as np
import pytest

from plexrl.policy.placement import PACKING_PAYS
from plexrl.sim.simulate import MODES, simulate
from plexrl.sim.workload import SimCluster, Workload

# 16 GPUs in one node group for five jobs that need 36: they queue, stack and switch.
CLUSTER = SimCluster(name="pin", nodes_per_pod=2, group_nodes=2)
WORKLOAD = Workload.model_validate({
    "name": "pinned", "seed": 3, "pack_limit": None, "pack_by_effect": False,
    "jobs": [
        {"name": "math", "count": 2, "params_b": 7, "dp": 8, "steps": 3, "arrival_every_s": 40, "slack": 1.0},
        {"name": "agent", "count": 2, "params_b": 7, "dp": 4, "steps": 3, "reward_s": 60, "slack": 1.0,
         "rollout": {"turns": 3, "tool_s": 90, "prompts": 64}},
        {"name": "code", "algorithm": "dapo", "params_b": 30, "active_params_b": 3, "tp": 2, "dp": 4,
         "steps": 2, "reward_s": 300, "slack": 1.0, "rollout": {"prompts": 64, "refill_fraction": 0.25}},
    ],
})

PINNED = {
    "colocated": (221, 9174.534602587655, 58949.573765875015, 60.800000000000026, 46801.63455637255),
    "split": (153, 13973.948277924665, 91065.88078119366, 27.680000000000003, 39773.88867401961),
    "plexrl": (175, 13299.004728519965, 43129.27544888474, 177.2000000000001, 43129.27544888471),
    "plexrl-hrrn": (175, 13299.004728519965, 43129.27544888474, 177.2000000000001, 43129.27544888471),
    "plexrl-sjf": (175, 13110.3805227908, 43125.48070920474, 173.84000000000015, 43125.48070920471),
    "plexrl-fcfs": (175, 13299.004728519965, 43129.27544888474, 177.2000000000001, 43129.27544888471),
    "plexrl-firstfit": (197, 9963.691277684131, 43628.82697180693, 72.48000000000002, 43628.826971806906),
    # one node group: packing first has no other group to prefer, so it places as `plexrl`
    "plexrl-pack": (175, 13299.004728519965, 43129.27544888474, 177.2000000000001, 43129.27544888471),
    "plexrl-noshift": (199, 12438.03012183345, 44354.0402740123, 155.92000000000007, 44354.04027401228),
    "plexrl-wholetail": (226, 14939.101305921535, 46888.99455637256, 148.16000000000014, 46888.99455637255),
    "plexrl-alltail": (165, 13165.854297861173, 42596.67372624957, 172.16000000000008, 42596.67372624955),
    "plexrl-pinned": (233, 9227.882784720374, 45709.345648039234, 67.52000000000001, 45709.34564803922),
    # no step boundary of `plexrl` finds a move (one that lets a waiting job start, or unused GPUs
    # for a job that shares), so without moves it runs as `plexrl`
    "plexrl-nomove": (175, 13299.004728519965, 43129.27544888474, 177.2000000000001, 43129.27544888471),
}
# `plexrl` under the fixed pack limit PACKING_PAYS (the default before packing by effect)
PINNED_PAYING = (228, 9189.444699462654, 46265.79005049021, 60.800000000000026, 46265.7900504902)
# `plexrl` under the default, packing by effect: the same decisions (no share here lowers the jobs'
# summed completion time: each would wait less for its own GPUs than sharing costs)
PINNED_BY_EFFECT = PINNED_PAYING


@pytest.fixture(scope="module")
def runs():
    return simulate(WORKLOAD, CLUSTER, MODES)["runs"]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_reproduces_its_pinned_figures_exactly(runs, mode):
    r = runs[mode]
    got = (r.events, sum(sum(j.step_times) for j in r.records), sum(j.charged_gpu_s for j in r.records),
           r.switch_gpu_s, r.busy_gpu_s)
    assert got == PINNED[mode]


def test_modes_run_in_several_processes_give_the_same_figures(runs):
    """`processes` only changes where the modes run: every record, ledger and busy interval of
    every mode is the one-process run's (the modes of one process share their caches, which
    are exact memos)."""
    apart = simulate(WORKLOAD, CLUSTER, MODES, processes=3)
    assert apart["processes"] == 3 and list(apart["runs"]) == list(MODES)
    for mode, r in apart["runs"].items():
        one = runs[mode]
        assert (r.events, r.end_s, r.records, r.ledger) == (one.events, one.end_s, one.records, one.ledger)
        assert all(np.array_equal(a, b) for a, b in zip(r.busy_intervals, one.busy_intervals))


def _plexrl_figures(workload: Workload) -> tuple:
    r = simulate(workload, CLUSTER, ("plexrl",))["runs"]["plexrl"]
    return (r.events, sum(sum(j.step_times) for j in r.records), sum(j.charged_gpu_s for j in r.records),
            r.switch_gpu_s, r.busy_gpu_s)


def test_the_fixed_pack_limit_reproduces_its_pinned_figures_exactly():
    assert _plexrl_figures(WORKLOAD.model_copy(update={"pack_limit": PACKING_PAYS})) == PINNED_PAYING


def test_the_default_packing_by_effect_reproduces_its_pinned_figures_exactly():
    default = Workload.model_validate({k: v for k, v in WORKLOAD.model_dump().items()
                                       if k not in ("pack_limit", "pack_by_effect")})
    assert default.pack_limit is None and default.pack_by_effect
    assert _plexrl_figures(default) == PINNED_BY_EFFECT


def test_the_pin_covers_every_mode():
    assert set(PINNED) == set(MODES)
