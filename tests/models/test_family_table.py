"""The README's family table is what benchmarks/family_table.py renders from the registry and verdicts."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("family_table", ROOT / "benchmarks" / "family_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_family_table_is_current() -> None:
    table = _module()
    readme = (ROOT / "README.md").read_text()
    assert table.render_readme(readme) == readme, "stale: run python benchmarks/family_table.py"


def test_the_table_says_how_each_family_was_admitted_and_why_one_was_refused() -> None:
    results = json.loads((ROOT / "benchmarks" / "results" / "model_families.json").read_text())
    rows = {
        line.split(" | ")[0][2:]: line
        for line in _module().table(results).splitlines()
        if line.startswith("| ")
    }
    assert "| registry |" in rows["llama"] and "| proof (self-check) |" in rows["olmo2"]
    refused = [r for r in rows.values() if "| refused |" in r]
    assert refused and all(r.rstrip(" |").split(" | ")[-1] for r in refused)  # every refusal says why
