"""A rank that raises inside a sharded forward stops the whole replica within seconds, with its error."""

from __future__ import annotations

import time

import torch

from nereus_lightning.models import ReplicaComm, ShardedCausalLM, forward_logits, replica_groups
from nereus_lightning.models.fail_fast import PeerFailure
from nereus_lightning.plan.layout import Layout
from nereus_lightning.testing import WorkerPool
from nereus_lightning.testing.tiny import VOCAB, tiny_model

INJECTED = "injected failure in stage 0's first layer"


def _raise_in_stage_zero(rank: int, world: int) -> tuple[str, str, float]:
    layout = Layout(1, 2)
    replica_groups([(0, 1)], layout)
    unit = ShardedCausalLM.from_model(tiny_model("llama"), ReplicaComm.of((0, 1), layout, rank))

    def fail(*_: object) -> None:
        raise RuntimeError(INJECTED)

    if rank == 0:
        unit.model.layers["0"].register_forward_pre_hook(fail)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    began = time.monotonic()
    try:
        forward_logits(unit, ids)  # stage 1 waits for stage 0's activations
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc), time.monotonic() - began
    return "none", "", time.monotonic() - began


def test_a_rank_that_raises_under_pp2_stops_its_peer_with_its_error() -> None:
    # Its own pool: the failure aborts the process groups of every rank, as it must in a real job.
    with WorkerPool(2) as pool:
        (kind0, text0, took0), (kind1, text1, took1) = pool.run(_raise_in_stage_zero)
    assert kind0 == "RuntimeError" and text0 == INJECTED
    assert kind1 == PeerFailure.__name__, f"stage 1 raised {kind1}: {text1}"
    assert f"rank 0: RuntimeError: {INJECTED}" in text1 and text1.startswith("rank 1 stopped because")
    assert max(took0, took1) < 10.0, f"stage 0 failed after {took0:.1f} s, stage 1 after {took1:.1f} s"
