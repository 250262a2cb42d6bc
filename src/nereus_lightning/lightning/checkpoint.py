"""The JSON metadata of a Nereus checkpoint directory, its atomic commit, and finding the newest good one.

A checkpoint is a directory: the tensors through DCP (``emu/<model_stage>/``, every model-stage's
units) and ``nereus_meta.json``: the format version, the
versions that wrote it, the size of every file, and Lightning's checkpoint dict (step, epoch,
loops, callback states such as the controller's, hyper-parameters, what the module adds) in
JSON. Reading it runs no code: values JSON lacks are tagged objects (:func:`encode`), built back
by :func:`decode` from plain data; the only classes it builds are ``nereus_lightning``
dataclasses. A directory is written under a hidden staging name and renamed into place when
complete (:func:`commit`), so a crash mid-save leaves the previous checkpoint of that name whole.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nereus_lightning.emu.checkpoint import DCP_METADATA, read_dcp_metadata
from nereus_lightning.spec.errors import CheckpointError

META_FILE = "nereus_meta.json"
LEGACY_META_FILE = "nereus_meta.pt"  # the pickled metadata before format 1: refused on resume
FORMAT = "nereus-checkpoint"
FORMAT_VERSION = 1
CONVERT_COMMAND = "nereus-convert-checkpoint"
_TAGS = ("__tuple__", "__float__", "__tensor__", "__dataclass__", "__items__")
_PACKAGE = "nereus_lightning"


# ---- values <-> JSON ------------------------------------------------------------------------------
def encode(value: Any, key: str = "checkpoint") -> Any:
    """``value`` as JSON data; a type JSON lacks becomes a one-key tagged object.

    Tuples, non-finite floats, tensors (dtype, shape, values), ``nereus_lightning`` dataclasses (every
    init field, so a new field comes along) and mappings with non-string keys are tagged; other
    mappings and sequences become objects and lists. Anything else raises :class:`CheckpointError`
    naming ``key`` (the path to the value) and its type.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"__float__": repr(float(value))}
    if isinstance(value, Tensor):
        return {"__tensor__": _encode_tensor(value, key)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"__dataclass__": _encode_dataclass(value, key)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{key}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and k not in _TAGS for k in value):
            return {k: encode(v, f"{key}.{k}") for k, v in value.items()}
        return {"__items__": [[encode(k, key), encode(v, f"{key}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        return [encode(v, f"{key}[{i}]") for i, v in enumerate(value)]
    raise CheckpointError(
        f"{key}: a {type(value).__module__}.{type(value).__qualname__} cannot be stored in the checkpoint's "
        "JSON metadata (it holds None, bool, int, float, str, lists, tuples, dicts, tensors and "
        f"{_PACKAGE} dataclasses); convert it in the state_dict() or on_save_checkpoint() that returns it"
        " (or leave a hyper-parameter out with save_hyperparameters(ignore=[...]))"
    )


def _encode_tensor(value: Tensor, key: str) -> dict[str, Any]:
    if value.is_complex() or value.layout != torch.strided:
        raise CheckpointError(
            f"{key}: a {value.dtype} {value.layout} tensor cannot be stored in the JSON metadata"
        )
    data = value.detach().cpu().tolist()
    return {
        "dtype": str(value.dtype).removeprefix("torch."),
        "shape": list(value.shape),
        "data": encode(data, key),
    }


def _encode_dataclass(value: Any, key: str) -> dict[str, Any]:
    cls = type(value)
    if cls.__module__.split(".")[0] != _PACKAGE:
        raise CheckpointError(
            f"{key}: a {cls.__module__}.{cls.__qualname__} cannot be stored in the JSON metadata (only "
            f"{_PACKAGE} dataclasses are); convert it to plain data in the state_dict() that returns it"
        )
    values = {
        f.name: encode(getattr(value, f.name), f"{key}.{f.name}") for f in dataclasses.fields(value) if f.init
    }
    return {"type": f"{cls.__module__}:{cls.__qualname__}", "fields": values}


def decode(value: Any, key: str = "checkpoint") -> Any:
    """Inverse of :func:`encode`; a tag it does not know, or a class outside ``nereus_lightning``, raises."""
    if isinstance(value, list):
        return [decode(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if len(value) != 1 or next(iter(value)) not in _TAGS:
        return {k: decode(v, f"{key}.{k}") for k, v in value.items()}
    tag, body = next(iter(value.items()))
    try:
        if tag == "__tuple__":
            return tuple(decode(v, f"{key}[{i}]") for i, v in enumerate(body))
        if tag == "__float__":
            if body not in ("inf", "-inf", "nan"):
                raise ValueError(f"{body!r} is not inf, -inf or nan")
            return float(body)
        if tag == "__items__":
            return {decode(k, key): decode(v, f"{key}[{k!r}]") for k, v in body}
        if tag == "__tensor__":
            return _decode_tensor(body, key)
        return _decode_dataclass(body, key)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{key}: a damaged {tag} value ({type(exc).__name__}: {exc})") from exc


def _decode_tensor(body: dict[str, Any], key: str) -> Tensor:
    dtype = getattr(torch, str(body["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{body['dtype']!r} is not a torch dtype")
    return torch.tensor(decode(body["data"], key), dtype=dtype).reshape([int(n) for n in body["shape"]])


def _decode_dataclass(body: dict[str, Any], key: str) -> Any:
    module, _, qualname = str(body["type"]).partition(":")
    if module.split(".")[0] != _PACKAGE:
        raise CheckpointError(f"{key}: refers to {body['type']!r}; only {_PACKAGE} dataclasses are built")
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise CheckpointError(f"{key}: {body['type']!r} is not a dataclass")
    return cls(**{name: decode(v, f"{key}.{name}") for name, v in body["fields"].items()})


# ---- the metadata file ----------------------------------------------------------------------------
@dataclass(frozen=True)
class StoredCheckpoint:
    """What ``nereus_meta.json`` says: Lightning's checkpoint dict, the state backend and the save time."""

    checkpoint: dict[str, Any]
    state: str  # "emu" (tensors under emu/<model_stage>/); "full" (the retired backend's) is not resumed
    saved_at: float


def write_metadata(directory: str | os.PathLike, encoded: Any, state: str) -> None:
    """Write ``nereus_meta.json`` (``encoded``: :func:`encode` of the checkpoint dict) last into
    ``directory``.
    """
    directory = Path(directory)
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": _versions(),
        "saved_at": time.time(),
        "state": state,
        "files": _file_sizes(directory),
        "checkpoint": encoded,
    }
    tmp = directory / f"{META_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / META_FILE)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": str(torch.__version__)}
    for name in ("nereus-lightning", "lightning"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "unknown"
    return out


def _file_sizes(directory: Path) -> dict[str, int]:
    skip = {META_FILE, f"{META_FILE}.tmp"}
    return {
        p.relative_to(directory).as_posix(): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name not in skip
    }


def read_checkpoint(directory: str | os.PathLike) -> StoredCheckpoint:
    """Read and check a checkpoint directory without unpickling anything.

    Raises :class:`CheckpointError` naming the file: no ``nereus_meta.json`` (an older pickled
    ``nereus_meta.pt`` is refused with the command that converts it), damaged JSON, another
    format version, a file missing or of another size than recorded, DCP metadata that is damaged
    or refers to anything but DCP's records (:func:`~nereus_lightning.emu.checkpoint.read_dcp_metadata`).
    """
    directory = Path(directory)
    meta = directory / META_FILE
    if not meta.is_file():
        if (directory / LEGACY_META_FILE).is_file():
            raise CheckpointError(
                f"ckpt_path: {directory} was written by an older nereus-lightning: its metadata "
                f"({LEGACY_META_FILE}) is a pickle, and loading a pickle can run any code, so it is not "
                f"loaded. If you trust where this checkpoint comes from, convert it once with "
                f"`{CONVERT_COMMAND} {directory}` (or `python -m nereus_lightning.cli.convert_checkpoint "
                f"{directory}`; it writes {META_FILE} next to it), then resume"
            )
        what = (
            "does not exist"
            if not directory.exists()
            else f"is not a Nereus checkpoint directory (no {META_FILE})"
        )
        raise CheckpointError(f"ckpt_path: {directory} {what}")
    try:
        doc = json.loads(meta.read_text(), parse_constant=_no_constant)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} metadata file")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta}: damaged ({type(exc).__name__}: {exc})") from exc
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{meta}: checkpoint format version {version!r}; this nereus-lightning reads version "
            f"{FORMAT_VERSION} (written by {doc.get('versions')}); use a matching nereus-lightning"
        )
    try:
        files, state, saved_at = dict(doc["files"]), str(doc["state"]), float(doc["saved_at"])
        encoded = doc["checkpoint"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{meta}: damaged ({type(exc).__name__}: {exc})") from exc
    for name, size in files.items():
        _check_file(directory, name, size)
    for name in files:
        if Path(name).name == DCP_METADATA:
            read_dcp_metadata((directory / name).parent)
    return StoredCheckpoint(decode(encoded), state, saved_at)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _check_file(directory: Path, name: str, size: Any) -> None:
    file = directory / name
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(f"{directory / META_FILE}: lists {name!r}, a file outside the checkpoint")
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (the checkpoint recorded {size} bytes)")
    if file.stat().st_size != size:
        raise CheckpointError(
            f"{file}: damaged: {file.stat().st_size} bytes, the checkpoint recorded {size} (truncated or "
            "overwritten)"
        )


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> str | None:
    """The newest good checkpoint directory under ``ckpt_dir`` (highest step, then latest save), None if none.

    Good: :func:`read_checkpoint` accepts it (complete, intact, current format). Every such
    checkpoint holds finite tensors only: a save with a NaN or an infinity in any state is refused.
    """
    found = []
    for path in Path(ckpt_dir).glob("*"):
        if path.name.startswith(".") or not path.is_dir():
            continue  # staging directories of unfinished saves
        try:
            stored = read_checkpoint(path)
        except CheckpointError:
            continue
        found.append((int(stored.checkpoint.get("global_step", 0)), stored.saved_at, str(path)))
    return max(found)[2] if found else None


# ---- writing a directory atomically ---------------------------------------------------------------
def staging_path(path: str | os.PathLike) -> Path:
    """The hidden directory a checkpoint for ``path`` is written into before :func:`commit` renames it."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


def commit(path: str | os.PathLike) -> None:
    """Rename the complete staging directory of ``path`` to ``path``, replacing what was there (one rank).

    The old directory is first renamed aside (``.<name>.previous``) and removed only after the new
    one is in place, so at no moment is a half-written directory called ``path``.
    """
    path = Path(path)
    previous = path.with_name(f".{path.name}.previous")
    remove(previous)
    if path.exists() or path.is_symlink():
        os.rename(path, previous)
    os.rename(staging_path(path), path)
    remove(previous)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the renames themselves reach the disk
    finally:
        os.close(fd)


def remove(path: str | os.PathLike) -> None:
    """Remove a file or a directory tree if it exists."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
