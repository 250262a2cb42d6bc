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


def test_expandable_segments_unless_the_user_configured_them(monkeypatch) -> None:
    import torch

    from nereus_lightning.lightning.strategy import use_expandable_segments

    given: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", given.append)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert use_expandable_segments()
    assert given == ["expandable_segments:True"]
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512,expandable_segments:True"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")  # the user's choice stands
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    assert not use_expandable_segments()
    assert given == ["expandable_segments:True"]
