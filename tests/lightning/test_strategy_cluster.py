"""The strategy prices transitions on the cluster it is given (the controller's), not on cpu4."""

from __future__ import annotations

import pytest

from nereus_lightning.lightning import NereusStrategy
from nereus_lightning.spec import CLUSTER_PRESETS
from nereus_lightning.spec.errors import NereusConfigError


class _Units:
    kind = "emu"

    def __init__(self) -> None:
        self.cluster = None
        self.last_transition: dict = {}
        self.seen = None

    def ensure(self, plan, models, rank) -> bool:  # noqa: ANN001
        self.seen = self.cluster
        return True


class _Module:
    def __init__(self) -> None:
        self.units = _Units()

    def role_models(self) -> dict:
        return {}


def _transition(strategy: NereusStrategy) -> _Units:
    module = _Module()
    strategy._lightning_module = module  # what the Trainer sets
    strategy.validate_plan = lambda plan: None
    strategy.barrier = lambda name=None: None
    strategy.transition(None)
    return module.units


def test_named_cluster_sized_to_world() -> None:
    from lightning.fabric.plugins.environments import LightningEnvironment

    env = LightningEnvironment()
    env.set_world_size(4)
    strategy = NereusStrategy(cluster="paper_cluster2", cluster_environment=env)
    units = _transition(strategy)
    assert units.seen.name == CLUSTER_PRESETS["paper_cluster2"].name
    assert units.seen.num_gpus == 4
    assert units.seen.gpu_memory == CLUSTER_PRESETS["paper_cluster2"].gpu_memory


def test_default_is_cpu4() -> None:
    assert _transition(NereusStrategy()).seen.name == CLUSTER_PRESETS["cpu4"].name


def test_unknown_cluster_fails_at_construction() -> None:
    with pytest.raises(NereusConfigError, match="paper_cluster1"):
        NereusStrategy(cluster="no_such_cluster")
