"""The in-reward KL coefficient: fixed, or adapted toward a target (verl's algorithm.kl_ctrl)."""

from __future__ import annotations

import pytest

from nereus_lightning.rl.kl_control import KLController
from nereus_lightning.spec.errors import NereusConfigError


def test_adaptive_coefficient_follows_ziegler_et_al():
    ctrl = KLController.of(0.1, {"type": "adaptive", "target_kl": 0.2, "horizon": 100})
    ctrl.update(0.3, 10)  # error clip(0.3/0.2 - 1) = 0.2: x (1 + 0.2 x 10/100) = 1.02
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(0.15, 50)  # error -0.25 clipped to -0.2: x (1 - 0.2 x 0.5) = 0.9
    assert ctrl.value == pytest.approx(0.0918)
    fixed = KLController.of(0.1, {"type": "fixed", "target_kl": 0.2})
    fixed.update(5.0, 100)
    assert fixed.value == 0.1


def test_bad_kl_ctrl_settings_name_their_key():
    with pytest.raises(NereusConfigError, match="algorithm.kl_ctrl.type"):
        KLController.of(0.1, {"type": "pid"})
    with pytest.raises(NereusConfigError, match="algorithm.kl_coef.*starts from a value > 0"):
        KLController.of(0.0, {"type": "adaptive"})
    with pytest.raises(NereusConfigError, match="unknown keys \\['target'\\]"):
        KLController.of(0.1, {"target": 1})
