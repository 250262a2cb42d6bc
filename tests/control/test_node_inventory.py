"""The node inventory's numbering, on one rank with a stand-in for the collectives."""

from __future__ import annotations

import pytest

from nereus_lightning.control import DeviceInventoryError, NodeInventory, StaticResources
from nereus_lightning.control.resources import visible_gpus
from nereus_lightning.spec.errors import NereusConfigError


class _OneRank:
    """The collectives of a one-rank job, counted."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def any(self, flag: bool) -> bool:
        self.calls.append("any")
        return flag

    def gather(self, value):  # noqa: ANN001, ANN201
        self.calls.append("gather")
        return [value]


def test_cuda_numbering_of_the_driver_gpus(monkeypatch):
    # CUDA's GPUs 0, 1 of node 3 are the driver's 2 and 5; the driver reports 5 and 7 usable.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    inventory, exchange = NodeInventory(local=lambda: StaticResources((5, 7))), _OneRank()
    inventory.attach(exchange, node_rank=3, local_rank=0, gpus_per_node=2)
    assert inventory.pool(0) == (7,)  # GPU 1 of node 3: rank 3 * 2 + 1
    assert inventory.pool(1) == (7,) and exchange.calls == ["gather", "any"]  # nothing changed: no gather
    assert visible_gpus(None, 3) == (0, 1, 2) and visible_gpus("3,1,0", 2) == (3, 1)
    with pytest.raises(DeviceInventoryError, match="CUDA_VISIBLE_DEVICES"):
        visible_gpus("GPU-1234,GPU-5678", 2)


def test_the_pool_needs_the_job():
    with pytest.raises(NereusConfigError, match="attach"):
        NodeInventory(local=lambda: StaticResources(2)).pool(0)
