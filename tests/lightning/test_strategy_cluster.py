"""The strategy prices transitions on the cluster it is given (the controller's), not on cpu4."""

from __future__ import annotations

import pytest

from nereus_lightning.lightning import NereusStrategy
from nereus_lightning.spec import CLUSTER_PRESETS
from nereus_lightning.spec.errors import NereusConfigError


def _priced_on(rank: int, world_size: int, cluster: str | None) -> tuple:
    """The cluster the strategy's units hand the transition brain (name, GPUs, per-GPU memory)."""
    from nereus_lightning.lightning import PPOModule
    from tests.lightning.helpers import small_task

    module = PPOModule(task=small_task(), prompts_per_step=2, seed=3)
    kwargs = {} if cluster is None else {"cluster": cluster}
    spec = NereusStrategy.without_trainer(module, **kwargs).units.cluster
    return spec.name, spec.num_gpus, spec.gpu_memory


@pytest.mark.distributed
def test_named_cluster_sized_to_world(dist4) -> None:
    given = CLUSTER_PRESETS["paper_cluster2"]
    assert set(dist4.run(_priced_on, "paper_cluster2")) == {(given.name, 4, given.gpu_memory)}


@pytest.mark.distributed
def test_default_is_cpu4(dist4) -> None:
    cpu4 = CLUSTER_PRESETS["cpu4"]
    assert set(dist4.run(_priced_on, None)) == {(cpu4.name, 4, cpu4.gpu_memory)}


def test_unknown_cluster_fails_at_construction() -> None:
    with pytest.raises(NereusConfigError, match="paper_cluster1"):
        NereusStrategy(cluster="no_such_cluster")
