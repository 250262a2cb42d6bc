"""nereus-check-model through its Python entry: bad input is refused before any process starts; the table."""

from __future__ import annotations

import pytest

from nereus_lightning.cli.check_model import check_config, check_from_config, render
from nereus_lightning.spec.errors import NereusConfigError


def test_bad_inputs_are_refused_before_any_process_starts(tmp_path) -> None:
    with pytest.raises(NereusConfigError, match="model.config: no config.json"):
        check_from_config(check_config([f"model.config={tmp_path}"]))
    with pytest.raises(NereusConfigError, match="world_size: must be 1, 2 or 4"):
        check_from_config(check_config([f"model.config={tmp_path}", "world_size=3"]))


def test_the_table_flags_errors_above_tolerance_and_changed_state(capsys) -> None:
    assert render({"tp2pp1/logits": 3e-7, "chain/merge_tp/state_diffs": 0.0}, 1e-5)
    assert not render({"tp2pp1/logits": 3e-7, "tp2pp2/logits": 0.25}, 1e-5)
    assert not render({"chain/split_pp/state_diffs": 1.0}, 1e-5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["tp2pp1/logits", "3.00e-07", "ok"]
    assert "tp2pp2/logits 2.50e-01 FAIL" in " ".join(" ".join(line.split()) for line in lines)
    assert lines[-1] == "errors above tolerance 1e-05"
