"""Placement: which devices of which node group a job's models live on, and with what phase
shift (docs/design.md §6).

`Placer.place(profile, now)` returns `Placement(group, phase_shift_s, score, devices,
inflation)` or `Wait(reason)`, and commits a placement it returns; `release(job)` gives the
room back. `decide` is the same decision without committing. Decisions are deterministic:
the same placer state, profile and time give the same answer.

One concept per module:
- `decisions.py`: the answers, `Placement` and `Wait`;
- `tenancy.py`: the placed jobs on the view and horizon, and the caches derived from them
  (one invalidation point);
- `search.py` (with `probes.py`, its exact pruning): the group, phase shift and devices where
  a job's projected load collides least;
- `cotenancy.py`: the co-tenancy (inflation) model, pure functions of job profiles;
- `judgement.py`: whether a placement keeps every job within its slack (and the pack limit);
- `refusal.py`: the bound that refuses a job everywhere without a search;
- `moves.py`: moving placed jobs to make room for a waiting one, or to spread out;
- `placer.py`: `Placer`, which composes them, and the `FirstFit` baseline.
"""

from plexrl.policy.placement.decisions import Placement, Wait
from plexrl.policy.placement.judgement import PACKING_PAYS
from plexrl.policy.placement.placer import FirstFit, Placer

__all__ = ["PACKING_PAYS", "FirstFit", "Placement", "Placer", "Wait"]
