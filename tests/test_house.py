"""The house's layering: no import cycle between sub-packages, the brain free of the body, models below.

Function-level imports count: an import inside a function is an arrow all the same.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "nereus_lightning"
BRAIN = {"spec", "plan", "control", "sim", "transition"}


def _arrows() -> dict[str, set[str]]:
    """Sub-package -> the sub-packages its modules import (anywhere in the module)."""
    out: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if len(parts) == 1:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                bits = name.split(".")
                if bits[0] == "nereus_lightning" and len(bits) > 1 and bits[1] != parts[0]:
                    if (ROOT / bits[1]).is_dir():
                        out[parts[0]].add(bits[1])
    return out


def _reach(arrows: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in arrows.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_sub_package_reaches_itself_through_another():
    arrows = _arrows()
    assert {"models", "rl", "engines", "lightning"} <= set(arrows)  # the walk found the house
    cycles = sorted(pkg for pkg in arrows if pkg in _reach(arrows, pkg))
    assert cycles == [], f"import cycles through {cycles}: {dict(arrows)}"


def test_models_sit_below_the_rl_engines_and_lightning_and_the_brain_imports_no_body():
    arrows = _arrows()
    assert arrows["models"] <= {"kernels", "plan", "spec"}, arrows["models"]
    for pkg in BRAIN:
        assert arrows.get(pkg, set()) <= BRAIN, (pkg, arrows.get(pkg))
