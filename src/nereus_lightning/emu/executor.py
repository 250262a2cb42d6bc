"""Run a whole transition DAG on the EMU runtime (work in progress: being built now)."""

from __future__ import annotations

from typing import Any


def execute_dag(dag: Any, *, rank_of: Any = None, device: Any = None, colocate: Any = None) -> Any:
    """Execute every node of ``dag`` in topological order on every rank; returns an ExecutionReport."""
    raise NotImplementedError("emu.executor.execute_dag is being built")
