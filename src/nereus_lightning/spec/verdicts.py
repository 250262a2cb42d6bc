"""Verdicts of the exactness self-check, cached per model type, transformers version and layout.

A model type outside the registry (``spec.families.FAMILIES``) is admitted by proof: the body's
self-check (``proof.admission``) runs a tiny random model of its config class at every layout the
plan may use and records here, per layout, whether the sharded model matched the unsharded one
(and the difference when it did not). The brain only reads these records (pure JSON, no torch):
:func:`~nereus_lightning.spec.families.family_of` admits a model type with an exact verdict and
refuses one with a failed verdict, naming the layout and the difference.

The cache lives in ``$NEREUS_FAMILY_CACHE`` if set, else ``$XDG_CACHE_HOME/nereus-lightning``
(``~/.cache/nereus-lightning``), one file ``families.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

#: The layouts a verdict must cover for a plan to use them freely (TP1/2 x PP1/2).
CHECKED_LAYOUTS = ("tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2")


@dataclass(frozen=True)
class LayoutVerdict:
    """One layout's outcome: exact or not, the worst error seen, and why it failed (empty when exact)."""

    exact: bool
    max_error: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class Verdict:
    """The self-check's verdict on one model type under one transformers version, per layout."""

    model_type: str
    transformers: str
    layouts: dict[str, LayoutVerdict] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def exact_layouts(self) -> tuple[str, ...]:
        """The layouts that were checked and found exact."""
        return tuple(name for name, v in self.layouts.items() if v.exact)

    @property
    def failure(self) -> tuple[str, LayoutVerdict] | None:
        """The first failed layout and its verdict, or None when every checked layout is exact."""
        return next(((n, v) for n, v in self.layouts.items() if not v.exact), None)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Verdict:
        """Rebuild a verdict written by :meth:`to_json`."""
        layouts = {k: LayoutVerdict(**v) for k, v in data.get("layouts", {}).items()}
        return cls(str(data["model_type"]), str(data["transformers"]), layouts, float(data.get("seconds", 0)))


def transformers_version() -> str:
    """The installed transformers version, read from its metadata (transformers is not imported)."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "none"


def cache_file() -> Path:
    """Where verdicts are kept: ``$NEREUS_FAMILY_CACHE`` or the user's cache folder."""
    root = os.environ.get("NEREUS_FAMILY_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "nereus-lightning")
    return Path(root) / "families.json"


def _key(model_type: str, version: str) -> str:
    return f"{model_type}@{version}"


def _read() -> dict[str, Any]:
    path = cache_file()
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}  # no cache yet, or one a crash left unreadable: the check runs again


def cached_verdict(model_type: str, version: str | None = None) -> Verdict | None:
    """The cached verdict on ``model_type`` under ``version`` (default: the installed transformers)."""
    entry = _read().get(_key(model_type, version or transformers_version()))
    return None if entry is None else Verdict.from_json(entry)


def save_verdict(verdict: Verdict) -> Path:
    """Record ``verdict`` (merged with the layouts already verified for it); returns the cache file."""
    data = _read()
    key = _key(verdict.model_type, verdict.transformers)
    old = data.get(key)
    layouts = {**(Verdict.from_json(old).layouts if old else {}), **verdict.layouts}
    merged = Verdict(verdict.model_type, verdict.transformers, layouts, verdict.seconds)
    data[key] = merged.to_json()
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)  # readers never see half a file
    return path


_TRIALS: set[str] = set()


@contextlib.contextmanager
def on_trial(model_type: str) -> Iterator[None]:
    """While the self-check runs: treat ``model_type`` as admitted so its tiny model can be built."""
    added = model_type not in _TRIALS
    _TRIALS.add(model_type)
    try:
        yield
    finally:
        if added:
            _TRIALS.discard(model_type)


def on_trial_now(model_type: str) -> bool:
    """Whether ``model_type`` is being checked in this process (see :func:`on_trial`)."""
    return model_type in _TRIALS
