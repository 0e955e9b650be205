"""Pure policy: priority, group queues, transition planning, placement, estimates, accounting,
and how elastic rollouts share replicas.

Shared by the real runtime and the simulator. Standard library and numpy only; no I/O, no
clock, no torch or ray: time is an argument and randomness an injected generator.
"""

from plexrl.policy.accounting import JobUsage, Ledger
from plexrl.policy.admission import MEASURED_STEPS, Admission, AdmissionQueue, Forecast, Waiting, measured_inflation
from plexrl.policy.decode import DecodeEstimator, DecodeModel
from plexrl.policy.estimates import BandwidthEstimator, ExecEstimator, Ewma
from plexrl.policy.group_queue import GroupQueue, Head
from plexrl.policy.horizon import Horizon
from plexrl.policy.placement import FirstFit, Placement, Placer, Wait
from plexrl.policy.placement.cotenancy import step_inflation
from plexrl.policy.priority import Policy, ReadyQueue, StepClock, choose, offload_estimate, priorities
from plexrl.policy.profile import (
    JobProfile,
    ModelMemory,
    average_demand,
    drift,
    drifted,
    profile_from_events,
    resample,
    waited_s,
)
from plexrl.policy.resources import NodeResources, NodeGroup, ResourceView
from plexrl.policy.rollout_share import share_replicas
from plexrl.policy.transitions import choose_window, plan_host_room, plan_load, plan_prefetch
from plexrl.policy.types import LoadPlan, NoFit, ResidencyView, StateInfo, Tier, Transition, TransitionKind

__all__ = [
    "MEASURED_STEPS", "Admission", "AdmissionQueue", "BandwidthEstimator", "DecodeEstimator", "DecodeModel", "ExecEstimator", "Ewma", "FirstFit",
    "Forecast", "GroupQueue", "Head", "Horizon", "JobProfile", "JobUsage", "Ledger", "LoadPlan", "ModelMemory", "NoFit", "NodeResources", "NodeGroup",
    "Placement", "Placer", "Policy", "ReadyQueue", "ResidencyView", "ResourceView", "StateInfo", "StepClock", "Tier", "Transition",
    "TransitionKind", "Wait", "Waiting", "average_demand", "choose", "choose_window", "drift", "drifted",
    "measured_inflation", "offload_estimate", "plan_host_room", "plan_load", "plan_prefetch", "priorities",
    "profile_from_events", "resample", "share_replicas", "step_inflation", "waited_s",
]
