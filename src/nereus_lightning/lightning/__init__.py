"""The Lightning surface: `NereusStrategy`, `NereusCallback`, the RL LightningModules and what a module gives
the strategy (`RoleModels`, `RoleModule`)."""

from nereus_lightning.lightning.callback import NereusCallback
from nereus_lightning.lightning.checkpointing import NereusCheckpoint
from nereus_lightning.lightning.module import GRPOModule, PPOModule, ReMaxModule, RLModule
from nereus_lightning.lightning.preemption import Preemption
from nereus_lightning.lightning.roles import RoleModels, RoleModule
from nereus_lightning.lightning.strategy import NereusStrategy

__all__ = [
    "GRPOModule",
    "NereusCallback",
    "NereusCheckpoint",
    "NereusStrategy",
    "PPOModule",
    "Preemption",
    "ReMaxModule",
    "RLModule",
    "RoleModels",
    "RoleModule",
]
