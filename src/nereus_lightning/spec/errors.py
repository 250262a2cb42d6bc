"""Errors raised for bad input; each names the field or constraint and the way out."""

from __future__ import annotations


class NereusConfigError(ValueError):
    """A user-supplied value is invalid; the message names the field and the valid choices."""


class InfeasiblePlanError(RuntimeError):
    """No plan fits the cluster; the message names the binding constraint."""


def require(condition: bool, field: str, message: str) -> None:
    """Raise :class:`NereusConfigError` naming ``field`` unless ``condition`` holds."""
    if not condition:
        raise NereusConfigError(f"{field}: {message}")


def unknown_preset(kind: str, name: str, known: list[str]) -> NereusConfigError:
    """The error for an unknown preset name, listing the known ones."""
    return NereusConfigError(f"unknown {kind} preset {name!r}; known presets: {', '.join(sorted(known))}")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file, key or tensor and the way out."""
