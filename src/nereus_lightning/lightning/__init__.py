"""The Lightning surface: `NereusStrategy`, `NereusCallback` and the RL LightningModules."""

from nereus_lightning.lightning.callback import NereusCallback, PoolFollower
from nereus_lightning.lightning.module import GRPOModule, PPOModule, ReMaxModule, RLModule
from nereus_lightning.lightning.strategy import NereusStrategy

__all__ = [
    "GRPOModule",
    "NereusCallback",
    "NereusStrategy",
    "PPOModule",
    "PoolFollower",
    "ReMaxModule",
    "RLModule",
]
