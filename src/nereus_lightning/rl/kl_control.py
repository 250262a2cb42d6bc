"""The in-reward KL coefficient over a run (verl's ``algorithm.kl_ctrl``): fixed, or adapted toward a target.

The adaptive rule is Ziegler et al.'s (2019), as verl and TRL apply it: after each step the coefficient
is multiplied by ``1 + clip(kl / target_kl - 1, -0.2, 0.2) * n / horizon``, ``n`` the step's samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nereus_lightning.spec.errors import require

KL_CTRL_TYPES = ("fixed", "adaptive")


@dataclass
class KLController:
    """The current in-reward KL coefficient and the rule that moves it."""

    value: float
    type: str = "fixed"
    target_kl: float = 0.1
    horizon: int = 10000

    @classmethod
    def of(cls, kl_coef: float, kl_ctrl: Mapping[str, Any] | None) -> KLController:
        """From ``algorithm.kl_coef`` and the ``algorithm.kl_ctrl`` mapping (type, target_kl, horizon)."""
        values = dict(kl_ctrl or {})
        values.pop("kl_coef", None)  # verl keeps the start value here; ours is algorithm.kl_coef
        unknown = set(values) - {"type", "target_kl", "horizon"}
        require(
            not unknown, "algorithm.kl_ctrl", f"unknown keys {sorted(unknown)}: use type, target_kl, horizon"
        )
        ctrl = cls(
            float(kl_coef),
            str(values.get("type", "fixed")),
            float(values.get("target_kl", 0.1)),
            int(values.get("horizon", 10000)),
        )
        require(
            ctrl.type in KL_CTRL_TYPES,
            "algorithm.kl_ctrl.type",
            f"{ctrl.type!r} is not one of fixed, adaptive",
        )
        if ctrl.type == "adaptive":
            require(ctrl.value > 0, "algorithm.kl_coef", "an adaptive KL coefficient starts from a value > 0")
            require(ctrl.target_kl > 0, "algorithm.kl_ctrl.target_kl", f"must be > 0, got {ctrl.target_kl}")
            require(ctrl.horizon >= 1, "algorithm.kl_ctrl.horizon", f"must be >= 1, got {ctrl.horizon}")
        return ctrl

    def update(self, kl: float, samples: int) -> None:
        """Move the coefficient after a step whose mean KL to the reference was ``kl`` over ``samples``."""
        if self.type == "adaptive":
            error = min(max(kl / self.target_kl - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * samples / self.horizon
