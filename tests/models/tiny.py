"""Rank helpers for the models tests; the tiny models themselves live in ``nereus_lightning.testing.tiny``."""

from __future__ import annotations

from nereus_lightning.models import ReplicaComm, replica_groups
from nereus_lightning.plan.layout import Layout
from nereus_lightning.testing.tiny import PAD, VOCAB, rel_err, tiny_config, tiny_model

__all__ = ["PAD", "VOCAB", "my_replica", "rel_err", "tiny_config", "tiny_model"]


def my_replica(rank: int, world: int, layout: Layout, tied: bool) -> tuple[int, ReplicaComm]:
    """Cover the world with replicas of ``layout`` (groups made on all ranks); this rank's index and comm."""
    size = layout.size
    replicas = [tuple(range(i * size, (i + 1) * size)) for i in range(world // size)]
    replica_groups(replicas, layout, tied=tied)
    index = rank // size
    dp = tuple(r[rank % size] for r in replicas)
    return index, ReplicaComm.of(replicas[index], layout, rank, tied=tied, dp_ranks=dp)
