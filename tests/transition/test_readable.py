"""``transition/`` stays readable: short functions and no module-level feature switches."""

from __future__ import annotations

import ast
from pathlib import Path

import nereus_lightning.transition as transition

SOURCES = sorted(Path(transition.__file__).parent.glob("*.py"))
MAX_FUNCTION_LINES = 120


def _parsed() -> list[tuple[str, ast.Module]]:
    return [(path.name, ast.parse(path.read_text(), filename=str(path))) for path in SOURCES]


def test_no_function_in_transition_is_longer_than_120_lines() -> None:
    too_long = [
        f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for name, tree in _parsed()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None
        if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert len(SOURCES) >= 8 and not too_long, too_long


def test_transition_has_no_module_level_feature_switches() -> None:
    """A module-level name bound to True or False is a switch some code path reads."""
    switches = [
        f"{name}:{node.lineno}"
        for name, tree in _parsed()
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, bool)
    ]
    assert not switches, switches
