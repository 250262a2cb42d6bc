"""JSON forms of plans for controller checkpoints (exact, unlike the log's compact form)."""

from __future__ import annotations

from typing import Any

from nereus_lightning.plan.layout import Candidate, Layout, Plan


def plan_to_state(plan: Plan | None) -> list[dict[str, Any]] | None:
    """An exact JSON-serialisable form of ``plan``."""
    if plan is None:
        return None
    return [
        {
            "name": n,
            "tp": c.layout.tp,
            "pp": c.layout.pp,
            "shard": c.layout.shard,
            "zero": c.layout.zero,
            "dp": c.dp,
            "gpus": list(c.gpus),
            "micro_batch": c.micro_batch,
            "recompute": c.recompute,
        }
        for n, c in plan.items()
    ]


def plan_from_state(state: list[dict[str, Any]] | None) -> Plan | None:
    """Inverse of :func:`plan_to_state`."""
    if state is None:
        return None
    return Plan(
        tuple(
            (
                s["name"],
                Candidate(
                    # checkpoints from before ZeRO hold no shard / zero: unsharded
                    Layout(s["tp"], s["pp"], s.get("shard", 1), s.get("zero", 0)),
                    s["dp"],
                    tuple(s["gpus"]),
                    s["micro_batch"],
                    s["recompute"],
                ),
            )
            for s in state
        )
    )
