"""Test support shipped with the package: a pool of gloo worker processes reused across calls."""

from nereus_lightning.testing.pool import WorkerError, WorkerPool

__all__ = ["WorkerError", "WorkerPool"]
