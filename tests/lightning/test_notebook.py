"""notebooks/train.ipynb runs a short training and shows the plot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "train.ipynb"


def test_train_notebook_executes_and_shows_the_plot():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    os.environ["NEREUS_NOTEBOOK_STEPS"] = "5"
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    text = "".join(o.get("text", "") for o in outputs)
    assert "initial" in text and "reward" in text
