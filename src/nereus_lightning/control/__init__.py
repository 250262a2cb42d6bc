"""The controller: monitor signals, resource providers, triggers, admission and the decision log (pure
Python).
"""

from nereus_lightning.control.backend import PlannerBackend, PlanningBackend
from nereus_lightning.control.controller import Controller, ControllerConfig
from nereus_lightning.control.decision import Decision, DecisionLog, describe_plan, plan_to_json
from nereus_lightning.control.follower import PlanController, PlanFollower, PoolFollower, data_parallel_plan
from nereus_lightning.control.forecast import LengthForecast
from nereus_lightning.control.resources import (
    DeviceInventoryError,
    NodeInventory,
    NvmlResources,
    ResourceProvider,
    SchedulerFileResources,
    SequenceResources,
    StaticResources,
    TraceResources,
    load_spot_trace,
    scale_count,
)
from nereus_lightning.control.signals import StepSignals, as_pool
from nereus_lightning.control.state import plan_from_state, plan_to_state
from nereus_lightning.control.triggers import (
    CrossingClock,
    DriftTrigger,
    PoolTrigger,
    Trigger,
    smallest_horizon,
)
from nereus_lightning.control.variants import (
    follow_pool,
    intact_plan,
    keep_layouts,
    place_near,
    relief_variants,
)

__all__ = [
    "Controller",
    "ControllerConfig",
    "CrossingClock",
    "Decision",
    "DecisionLog",
    "DeviceInventoryError",
    "DriftTrigger",
    "LengthForecast",
    "NodeInventory",
    "NvmlResources",
    "PlanController",
    "PlannerBackend",
    "PlanningBackend",
    "PlanFollower",
    "PoolFollower",
    "PoolTrigger",
    "ResourceProvider",
    "SchedulerFileResources",
    "SequenceResources",
    "StaticResources",
    "StepSignals",
    "TraceResources",
    "Trigger",
    "as_pool",
    "data_parallel_plan",
    "describe_plan",
    "follow_pool",
    "intact_plan",
    "keep_layouts",
    "load_spot_trace",
    "place_near",
    "plan_from_state",
    "plan_to_json",
    "plan_to_state",
    "relief_variants",
    "scale_count",
    "smallest_horizon",
]
