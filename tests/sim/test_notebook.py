"""notebooks/simulate.ipynb runs top to bottom and shows the plot."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "simulate.ipynb"


@pytest.mark.timeout(300)
def test_simulate_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot is not shown"
    text = "".join(o.get("text", "") for o in outputs)
    assert "nereus(gamma=0.5)" in text and "oracle" in text
    assert (tmp_path / "simulate_outputs" / "steps.png").exists()
