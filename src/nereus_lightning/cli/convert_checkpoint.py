"""``nereus-convert-checkpoint``: rewrite the pickled metadata of an older checkpoint as JSON, once.

Checkpoints written before format 1 keep their metadata in ``nereus_meta.pt``, a pickle, and
resuming refuses them (loading a pickle can run any code it carries); those of format 1 record their
files' sizes only, not their content hashes, and resuming refuses them too (their files cannot be
verified). If you trust where such a checkpoint comes from, run this once per directory, then resume
as usual::

    nereus-convert-checkpoint outputs/<run>/checkpoints/last.ckpt
    python -m nereus_lightning.cli.convert_checkpoint outputs/<run>/checkpoints/last.ckpt

The pickle is read by an unpickler that builds only what those files held (dicts, lists, tensors,
Lightning's ``AttributeDict``, ``nereus_lightning`` dataclasses) and refuses any other global; the
DCP tensor files are checked as a resume checks them and left untouched. It writes
``nereus_meta.json`` (format 2: every file's SHA-256, as the files are now) next to them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import torch

from nereus_lightning.emu.dcp_state import DCP_METADATA, RestrictedUnpickler, read_dcp_metadata
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
    """Write a current ``nereus_meta.json`` for the older checkpoint ``directory``; returns the file written.

    A pickled ``nereus_meta.pt`` (before format 1) is read by the restricted unpickler; a format-1
    ``nereus_meta.json`` (file sizes only) is kept as it is. Either way every file's SHA-256 is recorded as it
    is now: run it only on checkpoints you trust.
    """
    directory = Path(directory)
    meta = directory / META_FILE
    if meta.is_file():
        return _upgrade(directory)
    legacy = directory / LEGACY_META_FILE
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
    write_metadata(directory, encode(dict(checkpoint)), state, step_tensors=False)
    return meta


def _upgrade(directory: Path) -> Path:
    """Rewrite a format-1 ``nereus_meta.json`` (sizes only) with every file's SHA-256 (else: refused)."""
    meta = directory / META_FILE
    try:
        doc = json.loads(meta.read_text())
        version, encoded, state = doc["format_version"], doc["checkpoint"], str(doc["state"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta}: damaged ({type(exc).__name__}: {exc})") from exc
    if version != 1:
        raise CheckpointError(f"{meta}: format version {version!r}, nothing to convert")
    for name, size in dict(doc.get("files", {})).items():  # the files are still those it recorded
        if not (directory / name).is_file() or (directory / name).stat().st_size != size:
            raise CheckpointError(
                f"{directory / name}: missing or not of its recorded {size} bytes; not converted"
            )
    for metadata in sorted(directory.rglob(DCP_METADATA)):
        read_dcp_metadata(metadata.parent)
    write_metadata(directory, encoded, state, step_tensors=False)
    return meta


def main(argv: list[str] | None = None) -> None:
    """The ``nereus-convert-checkpoint`` entry point."""
    parser = argparse.ArgumentParser(
        prog="nereus-convert-checkpoint",
        description=f"Rewrite the pickled {LEGACY_META_FILE} (or a format-1 {META_FILE}) of older Nereus "
        f"checkpoints as a current {META_FILE}, recording every file's SHA-256. "
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
