"""The JSON metadata of a Nereus checkpoint directory, its atomic commit, and finding the newest good one.

A checkpoint is a directory: the tensors through DCP (``emu/<model_stage>/``, every model-stage's
units) and ``nereus_meta.json``: the format version, the versions that wrote it, the size and
SHA-256 of every other file (:mod:`~nereus_lightning.lightning.integrity`, checked on resume), and
Lightning's checkpoint dict (step, epoch, loops, callback states such as the controller's,
hyper-parameters, what the module adds) in JSON. Reading it runs no code: values JSON lacks are
tagged objects (:func:`encode`), built back by :func:`decode` from plain data; the only classes it
builds are the plan's record types (:func:`record_types`), from their fields, and every value a
resume uses is checked (:mod:`~nereus_lightning.lightning.checkpoint_values`). A directory is
written under a hidden staging name and renamed into place when complete (:func:`commit`), so a
crash mid-save leaves the previous checkpoint of that name whole.
"""

from __future__ import annotations

import dataclasses
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

from nereus_lightning.emu.dcp_state import DCP_METADATA, STEP_KEY, load_tensors, read_dcp_metadata
from nereus_lightning.lightning.integrity import (
    HASH,
    FileRecord,
    describe,
    differing,
    digests,
    mismatch_error,
    own_files,
    parse_records,
)
from nereus_lightning.spec.errors import CheckpointError

META_FILE = "nereus_meta.json"
LEGACY_META_FILE = "nereus_meta.pt"  # the pickled metadata before format 1: refused on resume
FORMAT = "nereus-checkpoint"
FORMAT_VERSION = 2  # 2: every file's SHA-256 and the step inside the tensors; 1: sizes only (convert it)
CONVERT_COMMAND = "nereus-convert-checkpoint"
_META_FILES = (META_FILE, f"{META_FILE}.tmp")
_TAGS = ("__tuple__", "__float__", "__tensor__", "__dataclass__", "__items__")
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32)
    + (torch.int16, torch.int8, torch.uint8, torch.bool)
}


# ---- values <-> JSON ------------------------------------------------------------------------------
def encode(value: Any, key: str = "checkpoint") -> Any:
    """``value`` as JSON data; a type JSON lacks becomes a one-key tagged object.

    Tuples, non-finite floats, tensors (dtype, shape, values), the record types (:func:`record_types`;
    every init field, so a new field comes along) and mappings with non-string keys are tagged; other
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
        "plans); convert it in the state_dict() or on_save_checkpoint() that returns it"
        " (or leave a hyper-parameter out with save_hyperparameters(ignore=[...]))"
    )


def _encode_tensor(value: Tensor, key: str) -> dict[str, Any]:
    if value.dtype not in _DTYPES.values() or value.layout != torch.strided:
        raise CheckpointError(
            f"{key}: a {value.dtype} {value.layout} tensor cannot be stored in the JSON metadata (dtypes "
            f"{', '.join(_DTYPES)})"
        )
    data = value.detach().cpu().tolist()
    return {
        "dtype": str(value.dtype).removeprefix("torch."),
        "shape": list(value.shape),
        "data": encode(data, key),
    }


def record_types() -> dict[str, type]:
    """The record types a checkpoint's JSON may hold, by ``module:qualname``: the plan's dataclasses.

    The decoder builds these and nothing else (no import, no attribute lookup by a name the file gives);
    the encoder refuses any other dataclass, naming its key, so a save never writes what cannot be read.
    """
    from nereus_lightning.emu.unit import Counters
    from nereus_lightning.plan.layout import Candidate, Layout, Plan

    return {f"{cls.__module__}:{cls.__qualname__}": cls for cls in (Plan, Candidate, Layout, Counters)}


def _encode_dataclass(value: Any, key: str) -> dict[str, Any]:
    cls = type(value)
    name = f"{cls.__module__}:{cls.__qualname__}"
    if record_types().get(name) is not cls:
        raise CheckpointError(
            f"{key}: a {cls.__module__}.{cls.__qualname__} cannot be stored in the JSON metadata (its record "
            f"types are {', '.join(sorted(record_types()))}); convert it to plain data in the state_dict() "
            "that returns it"
        )
    values = {
        f.name: encode(getattr(value, f.name), f"{key}.{f.name}") for f in dataclasses.fields(value) if f.init
    }
    return {"type": name, "fields": values}


def decode(value: Any, key: str = "checkpoint") -> Any:
    """Inverse of :func:`encode`; a tag it does not know, or a type outside :func:`record_types`, raises."""
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
    dtype = _DTYPES.get(str(body["dtype"]))
    if dtype is None:
        raise ValueError(f"{body['dtype']!r} is not one of the dtypes {', '.join(_DTYPES)}")
    return torch.tensor(decode(body["data"], key), dtype=dtype).reshape([int(n) for n in body["shape"]])


def _decode_dataclass(body: dict[str, Any], key: str) -> Any:
    """One of :func:`record_types`, built from its init fields only (a field it lacks, or a value its
    constructor refuses, raises naming ``key``)."""
    cls = record_types().get(str(body["type"]))
    if cls is None:
        raise CheckpointError(
            f"{key}: refers to {body['type']!r}; only the record types {', '.join(sorted(record_types()))} "
            "are built"
        )
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    given = body["fields"]
    if not isinstance(given, dict) or not set(given) <= fields:
        raise CheckpointError(f"{key}: {body['type']!r} has no fields {sorted(set(given) - fields)}")
    return cls(**{name: decode(v, f"{key}.{name}") for name, v in given.items()})


# ---- the metadata file ----------------------------------------------------------------------------
@dataclass(frozen=True)
class StoredCheckpoint:
    """What ``nereus_meta.json`` says: Lightning's checkpoint dict, the state backend, the save time, every
    file beside it (:class:`~nereus_lightning.lightning.integrity.FileRecord`) and the directory read."""

    checkpoint: dict[str, Any]
    state: str  # "emu" (tensors under emu/<model_stage>/); "full" (the retired backend's) is not resumed
    saved_at: float
    files: dict[str, FileRecord] = dataclasses.field(default_factory=dict)
    path: str = ""  # the directory, symbolic links (last.ckpt) resolved
    step_tensors: bool = False  # each model-stage's DCP state holds the step it was saved at

    @property
    def global_step(self) -> int:
        """The optimizer steps the checkpoint was saved after (checked by :func:`read_metadata`)."""
        return int(self.checkpoint["global_step"])


def write_metadata(
    directory: str | os.PathLike,
    encoded: Any,
    state: str,
    files: Mapping[str, FileRecord] | None = None,
    step_tensors: bool = True,
) -> None:
    """Write ``nereus_meta.json`` (``encoded``: :func:`encode` of the checkpoint dict) last into
    ``directory``.

    ``files``: the record of every other file in it (None: hashed here, on this process's threads).
    ``step_tensors``: each model-stage's DCP state holds :data:`STEP_KEY` (what :func:`check_step_tensors`
    reads back).
    """
    directory = Path(directory)
    if files is None:
        names = own_files(directory, skip=_META_FILES)
        files = describe(directory, names, digests(directory, names))
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": _versions(),
        "saved_at": time.time(),
        "state": state,
        "step_tensors": step_tensors,
        "files": {name: {"size": r.size, HASH: r.sha256} for name, r in sorted(files.items())},
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


def read_checkpoint(directory: str | os.PathLike, verify: bool = True) -> StoredCheckpoint:
    """Read and check a checkpoint directory without unpickling anything (:func:`read_metadata`); with
    ``verify`` also every file's content hash (:func:`verify_files`) and the step inside its tensors
    (:func:`check_step_tensors`).
    """
    stored = read_metadata(directory)
    if verify:
        verify_files(stored)
        check_step_tensors(stored)
    return stored


def read_metadata(directory: str | os.PathLike) -> StoredCheckpoint:
    """Read ``nereus_meta.json`` and check the directory against it, without reading the files' contents.

    Raises :class:`CheckpointError` naming the file: no ``nereus_meta.json`` (an older pickled
    ``nereus_meta.pt``, or a format-1 checkpoint without content hashes, is refused with the command that
    converts it), damaged JSON, another format version, a symbolic link anywhere in the directory, a file
    missing or of another size than recorded, DCP metadata that is damaged or refers to anything but DCP's
    records (:func:`~nereus_lightning.emu.dcp_state.read_dcp_metadata`), or a value no run could have
    saved (:func:`~nereus_lightning.lightning.checkpoint_values.check_values`, naming the field).
    """
    from nereus_lightning.lightning.checkpoint_values import check_values

    directory = Path(os.path.realpath(directory))  # last.ckpt names the newest checkpoint by a link
    meta = directory / META_FILE
    if not meta.is_file() or meta.is_symlink():
        raise CheckpointError(_no_metadata(directory))
    doc = _load_doc(meta)
    try:
        state, saved_at = str(doc["state"]), float(doc["saved_at"])
        encoded, step_tensors = doc["checkpoint"], bool(doc.get("step_tensors", False))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{meta}: damaged ({type(exc).__name__}: {exc})") from exc
    files = parse_records(doc.get("files"), meta)
    present = set(own_files(directory, skip=_META_FILES))  # refuses a symbolic link anywhere in it
    for name, record in files.items():
        _check_file(directory, name, record.size, name in present)
    for name in files:
        if Path(name).name == DCP_METADATA:
            read_dcp_metadata((directory / name).parent)
    checkpoint = decode(encoded)
    check_values(checkpoint, meta)
    return StoredCheckpoint(checkpoint, state, saved_at, files, str(directory), step_tensors)


def _no_metadata(directory: Path) -> str:
    """Why ``directory`` has no metadata to read, and the way out."""
    if (directory / LEGACY_META_FILE).is_file():
        return (
            f"ckpt_path: {directory} was written by an older nereus-lightning: its metadata "
            f"({LEGACY_META_FILE}) is a pickle, and loading a pickle can run any code, so it is not "
            f"loaded. If you trust where this checkpoint comes from, convert it once with "
            f"`{CONVERT_COMMAND} {directory}` (or `python -m nereus_lightning.cli.convert_checkpoint "
            f"{directory}`; it writes {META_FILE} next to it), then resume"
        )
    if (directory / META_FILE).is_symlink():
        return f"{directory / META_FILE}: a symbolic link; a checkpoint is read from its own files only"
    what = (
        "does not exist"
        if not directory.exists()
        else f"is not a Nereus checkpoint directory (no {META_FILE})"
    )
    return f"ckpt_path: {directory} {what}"


def _load_doc(meta: Path) -> dict[str, Any]:
    """The parsed metadata document, of this format version (a format-1 one: refused with the converter)."""
    try:
        doc = json.loads(meta.read_text(), parse_constant=_no_constant)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} metadata file")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta}: damaged ({type(exc).__name__}: {exc})") from exc
    version = doc.get("format_version")
    if version == 1:
        raise CheckpointError(
            f"{meta}: checkpoint format version 1 records file sizes only, not their content hashes, so its "
            f"files cannot be verified. If you trust where it comes from, record them once with "
            f"`{CONVERT_COMMAND} {meta.parent}`, then resume"
        )
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{meta}: checkpoint format version {version!r}; this nereus-lightning reads version "
            f"{FORMAT_VERSION} (written by {doc.get('versions')}); use a matching nereus-lightning"
        )
    return doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _check_file(directory: Path, name: str, size: int, present: bool) -> None:
    file = directory / name
    if not present:
        raise CheckpointError(f"{file}: missing (the checkpoint recorded {size} bytes)")
    if file.stat().st_size != size:
        raise CheckpointError(
            f"{file}: damaged: {file.stat().st_size} bytes, the checkpoint recorded {size} (truncated or "
            "overwritten)"
        )


def verify_files(stored: StoredCheckpoint, names: Sequence[str] | None = None) -> float:
    """Re-hash ``names`` (None: every file) of ``stored`` and compare with the record; returns the seconds.

    Raises :class:`CheckpointError` naming the file whose content differs, or ``nereus_meta.json`` when
    several do (metadata and files of different saves).
    """
    started = time.perf_counter()
    names = list(stored.files) if names is None else list(names)
    bad = differing(stored.path, stored.files, names)
    if bad:
        raise mismatch_error(Path(stored.path), META_FILE, bad, len(names))
    return time.perf_counter() - started


def check_step_tensors(stored: StoredCheckpoint) -> None:
    """Each model-stage's DCP state holds the step ``nereus_meta.json`` gives (one small read per stage).

    Raises :class:`CheckpointError` naming the model-stage's directory and both steps.
    """
    if not stored.step_tensors:
        return
    for name in stored.files:
        if Path(name).name != DCP_METADATA:
            continue
        stage = (Path(stored.path) / name).parent
        box = {STEP_KEY: torch.zeros(1, dtype=torch.int64)}
        load_tensors(box, stage, alone=True)
        found = int(box[STEP_KEY][0])
        if found != stored.global_step:
            raise CheckpointError(
                f"{stage}: its tensors were saved at step {found}, but {Path(stored.path) / META_FILE} says "
                f"step {stored.global_step}: the metadata and the tensors come from different saves; resume "
                "from another checkpoint"
            )


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> str | None:
    """The newest good checkpoint directory under ``ckpt_dir`` (highest step, then latest save), None if none.

    Good: :func:`read_metadata` accepts it (complete, every file of its recorded size, current format;
    resuming also checks the contents). Links (``last.ckpt``) count as what they point to, which is what is
    returned. Every such checkpoint holds finite tensors only: a save with a NaN or an infinity is refused.
    """
    found = []
    for path in Path(ckpt_dir).glob("*"):
        if path.name.startswith(".") or not path.is_dir():
            continue  # staging directories of unfinished saves
        try:
            stored = read_metadata(path)
        except CheckpointError:
            continue
        found.append((stored.global_step, stored.saved_at, stored.path))
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


def replace_path(new: Path, dest: Path) -> None:
    """Put ``new`` (a file, link or complete folder) at ``dest``, replacing what is there, never
    following a link. A folder in the way is renamed aside first and removed after, so ``dest``
    names a complete thing at every moment but one rename."""
    if dest.is_dir() and not dest.is_symlink():
        aside = dest.with_name(f".{dest.name}.previous")
        remove(aside)
        os.rename(dest, aside)
        os.rename(new, dest)
        remove(aside)
    elif new.is_dir() and not new.is_symlink() and (dest.is_symlink() or dest.exists()):
        dest.unlink()  # a folder cannot be renamed over a file or link
        os.rename(new, dest)
    else:
        os.replace(new, dest)
