"""Pure policy: priority, transition planning, estimates, accounting (and placement).

Shared by the real runtime and the simulator. Standard library and numpy only; no I/O, no
clock, no torch or ray: time is an argument and randomness an injected generator.
"""

from plexrl.policy.accounting import JobUsage, Ledger
from plexrl.policy.estimates import BandwidthEstimator, ExecEstimator, Ewma
from plexrl.policy.priority import Policy, ReadyQueue, choose, offload_estimate, priorities
from plexrl.policy.transitions import choose_window, plan_host_room, plan_load
from plexrl.policy.types import LoadPlan, NoFit, ResidencyView, StateInfo, Tier, Transition, TransitionKind

__all__ = [
    "BandwidthEstimator", "ExecEstimator", "Ewma", "JobUsage", "Ledger", "LoadPlan", "NoFit",
    "Policy", "ReadyQueue", "ResidencyView", "StateInfo", "Tier", "Transition", "TransitionKind",
    "choose", "choose_window", "offload_estimate", "plan_host_room", "plan_load", "priorities",
]
