"""What is being run: models, clusters, workloads and the RL workflow (pure Python)."""

from nereus_lightning.spec.cluster import CLUSTER_PRESETS, ClusterSpec, cluster_preset
from nereus_lightning.spec.errors import InfeasiblePlanError, NereusConfigError
from nereus_lightning.spec.model import MODEL_PRESETS, ModelSpec, model_preset
from nereus_lightning.spec.workload import (
    STAGES,
    GenerationEngine,
    ModelStage,
    Workload,
    stages_of,
    workflow,
)

__all__ = [
    "CLUSTER_PRESETS",
    "MODEL_PRESETS",
    "STAGES",
    "ClusterSpec",
    "GenerationEngine",
    "InfeasiblePlanError",
    "ModelSpec",
    "ModelStage",
    "NereusConfigError",
    "Workload",
    "cluster_preset",
    "model_preset",
    "stages_of",
    "workflow",
]
