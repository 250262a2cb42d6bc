"""``nereus-convert-checkpoint``: rewrite the pickled metadata of an older checkpoint as JSON, once.

Checkpoints written before format 1 keep their metadata in ``nereus_meta.pt``, a pickle, and
resuming refuses them (loading a pickle can run any code it carries). If you trust where such a
checkpoint comes from, run this once per directory, then resume as usual::

    nereus-convert-checkpoint outputs/<run>/checkpoints/last.ckpt
    python -m nereus_lightning.cli.convert_checkpoint outputs/<run>/checkpoints/last.ckpt

The pickle is read by an unpickler that builds only what those files held (dicts, lists, tensors,
Lightning's ``AttributeDict``, ``nereus_lightning`` dataclasses) and refuses any other global; the
DCP tensor files are checked as a resume checks them and left untouched. It writes
``nereus_meta.json`` next to ``nereus_meta.pt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import sys
from pathlib import Path
from typing import Any

import torch

from nereus_lightning.emu.checkpoint import DCP_METADATA, RestrictedUnpickler, read_dcp_metadata
from nereus_lightning.lightning.checkpoint import LEGACY_META_FILE, META_FILE, encode, write_metadata
from nereus_lightning.spec.errors import CheckpointError

_LEGACY_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("torch._utils", "_rebuild_tensor_v2"),  # a tensor from its storage, offset, size and stride
    ("lightning.fabric.utilities.data", "AttributeDict"),
    ("lightning.pytorch.utilities.parsing", "AttributeDict"),
}


def _storage_from_bytes(data: bytes) -> Any:
    """What ``torch.storage._load_from_bytes`` returns, read in weights-only mode."""
    return torch.load(io.BytesIO(data), weights_only=True)


def legacy_global(module: str, name: str) -> Any:
    """The globals an older ``nereus_meta.pt`` needs (None: refused, nothing imported)."""
    if (module, name) == ("torch.storage", "_load_from_bytes"):
        return _storage_from_bytes
    if (module, name) in _LEGACY_GLOBALS:
        return getattr(importlib.import_module(module), name)
    if module.split(".")[0] == "nereus_lightning":
        found = getattr(importlib.import_module(module), name, None)
        if isinstance(found, type) and dataclasses.is_dataclass(found):
            return found
    return None


def convert(directory: str | Path) -> Path:
    """Write ``nereus_meta.json`` for the older checkpoint ``directory``; returns the file written."""
    directory = Path(directory)
    legacy = directory / LEGACY_META_FILE
    if (directory / META_FILE).is_file():
        raise CheckpointError(f"{directory}: already has {META_FILE}; nothing to convert")
    if not legacy.is_file():
        raise CheckpointError(
            f"{legacy}: missing; {directory} is not a checkpoint of an older nereus-lightning"
        )
    try:
        with open(legacy, "rb") as f:
            checkpoint = RestrictedUnpickler(f, legacy_global).load()
    except Exception as exc:
        raise CheckpointError(f"{legacy}: cannot be converted ({type(exc).__name__}: {exc})") from exc
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{legacy}: holds a {type(checkpoint).__name__}, not a checkpoint dict")
    state = checkpoint.pop("nereus_state", "full")
    for metadata in sorted(directory.rglob(DCP_METADATA)):
        read_dcp_metadata(metadata.parent)
    write_metadata(directory, encode(dict(checkpoint)), state)
    return directory / META_FILE


def main(argv: list[str] | None = None) -> None:
    """The ``nereus-convert-checkpoint`` entry point."""
    parser = argparse.ArgumentParser(
        prog="nereus-convert-checkpoint",
        description=f"Rewrite the pickled {LEGACY_META_FILE} of older Nereus checkpoints as {META_FILE}. "
        "Run it only on checkpoints from a source you trust.",
    )
    parser.add_argument(
        "checkpoints", nargs="+", help="checkpoint directories (e.g. .../checkpoints/last.ckpt)"
    )
    args = parser.parse_args(argv)
    failed = False
    for path in args.checkpoints:
        try:
            print(f"converted: {convert(path)}")
        except CheckpointError as exc:
            print(f"nereus-convert-checkpoint: {exc}", file=sys.stderr)
            failed = True
    sys.exit(2 if failed else 0)


if __name__ == "__main__":
    main()
