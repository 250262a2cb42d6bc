"""The README's family table, from the registry and the self-check verdicts of ``family_sweep.py``.

It sits in the README between ``<!-- families table -->`` and ``<!-- end families table -->``.
``python benchmarks/family_table.py`` rewrites it from ``benchmarks/results/model_families.json``;
``--check`` only says whether it is stale (exit 1), as ``tests/models/test_family_table.py`` does.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results" / "model_families.json"
# Its own markers: readme_tables.py owns the "generated:" regions.
REGION = re.compile(r"(<!-- families table -->\n)(.*?)(<!-- end families table -->)", re.S)
LAYOUTS = ("tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2", "split_merge")


def _row(name: str, entry: dict[str, Any], registered: bool) -> str:
    layouts = entry["layouts"]
    verified = [k for k in LAYOUTS if layouts.get(k, {}).get("exact")]
    failed = next(((k, v) for k, v in layouts.items() if not v["exact"]), None)
    if failed is None and len(verified) == len(LAYOUTS):
        how = "registry" if registered else "proof (self-check)"
    else:
        how = "refused"
    shown = ", ".join(v.replace("split_merge", "Split/Merge") for v in verified) or "none"
    why = "" if failed is None else f"{failed[0]}: {failed[1]['reason']}"
    why = why.replace("|", "/")[:110]
    return f"| {name} | `{entry['model_type']}` | {how} | {shown} | {why} |"


def table(results: dict[str, Any] | None = None) -> str:
    """The markdown table: one row per swept family, then the counts."""
    from nereus_lightning.spec.families import FAMILIES

    results = json.loads(RESULTS.read_text()) if results is None else results
    head = [
        "| family | model_type | admitted by | layouts verified exact | refused because |",
        "|---|---|---|---|---|",
    ]
    rows = [_row(n, e, e["model_type"] in FAMILIES) for n, e in sorted(results.items())]
    exact = sum(" refused " not in r for r in rows)
    version = next(iter(results.values()), {}).get("transformers", "?")
    foot = (
        f"\n{exact} of {len(rows)} families and variants exact at every layout (transformers {version}); "
        f"the rest are refused with the layout and the reason.\n"
    )
    return "\n".join([*head, *rows]) + "\n" + foot


def render_readme(text: str) -> str:
    """``text`` with its families region replaced by :func:`table`."""
    if not REGION.search(text):
        raise SystemExit("README.md has no <!-- families table --> region")
    return REGION.sub(lambda m: m.group(1) + table() + m.group(3), text)


if __name__ == "__main__":
    current = README.read_text()
    fresh = render_readme(current)
    if "--check" in sys.argv:
        sys.exit(0 if fresh == current else 1)
    README.write_text(fresh)
