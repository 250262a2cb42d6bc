"""DCP's ``.metadata`` read without running code from it, and checked against the data files.

DCP's own ``FileSystemReader.read_metadata`` unpickles the file with the unrestricted ``pickle`` module
(torch 2.4 to 2.13), so a file could run any code. :class:`RestrictedUnpickler` resolves only the globals
``allow`` names, and fills objects only as records: ``BUILD`` (the opcode that sets attributes) is
refused on a class, a module or anything but an instance of an allowed record type, and may set only that
type's dataclass fields, so no file can change a class for the whole process (e.g.
``setattr(Metadata, ...)`` or ``setattr(pathlib.PosixPath, ...)``). :func:`read_dcp_metadata` then checks
every record (types, shapes, chunk bounds, data-file names, offsets and lengths) and that each tensor's
declared size is backed by data in its files, naming the file and the entry that fails.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from nereus_lightning.spec.errors import CheckpointError

DCP_METADATA = ".metadata"  # the file DCP writes last, after every rank's data files
#: The most elements one tensor of a checkpoint may declare (2^40, 4 TB of fp32).
MAX_NUMEL = 1 << 40
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_DCP_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name
    ("collections", "OrderedDict"),
    *((module, cls) for module in ("pathlib", "pathlib._local") for cls in ("PosixPath", "WindowsPath")),
}
#: Record types whose own ``__setstate__`` BUILD may call (read: it assigns its fields from a tuple).
_SETSTATE_RECORDS = (TensorProperties,)


class RestrictedUnpickler(pickle._Unpickler):
    """An unpickler that resolves a global only through ``allow(module, name)`` (None: refused, nothing
    imported) and fills only instances of record types (``fills(cls)``; default: dataclasses), field by field.

    The pure-Python unpickler, so that ``BUILD`` can be checked (the C one calls ``setattr`` on whatever
    is on its stack, a class included); metadata files are small.
    """

    dispatch = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # (the pure-Python unpickler's stack)

    def __init__(
        self, file: BinaryIO, allow: Callable[[str, str], Any], fills: Callable[[type], bool] | None = None
    ) -> None:
        super().__init__(file)
        self._allow = allow
        self._fills = fills or dataclasses.is_dataclass

    def find_class(self, module: str, name: str) -> Any:
        """The allowed global, or an ``UnpicklingError`` naming the one refused."""
        found = self._allow(module, name)
        if found is None:
            raise pickle.UnpicklingError(
                f"it refers to {module}.{name}, which this file never needs; refused"
            )
        return found

    def load_build(self) -> None:
        """``BUILD``: set the declared fields of an instance of a record type, nothing else."""
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if isinstance(inst, type) or not self._fills(cls):
            raise pickle.UnpicklingError(
                f"it sets attributes of {_describe(inst)}; only the fields of a record it built may be set; "
                "refused"
            )
        if cls in _SETSTATE_RECORDS:
            if not isinstance(state, tuple):
                raise pickle.UnpicklingError(f"a {cls.__name__} built from a {type(state).__name__}; refused")
            cls.__setstate__(inst, state)
            return
        if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
            state = state[0]
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(state, dict) or not set(state) <= names:
            extra = sorted(map(str, set(state) - names)) if isinstance(state, dict) else type(state).__name__
            raise pickle.UnpicklingError(
                f"it sets {extra} of a {cls.__name__}, which has no such fields; refused"
            )
        for key, value in state.items():
            object.__setattr__(inst, key, value)

    dispatch[pickle.BUILD[0]] = load_build  # type: ignore[assignment]  # (typed for the base class)


def _describe(value: Any) -> str:
    """``value`` named for an error: a class or module by name, anything else by its type."""
    if isinstance(value, type):
        return f"the class {value.__module__}.{value.__qualname__}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def dcp_global(module: str, name: str) -> Any:
    """The globals a DCP ``.metadata`` pickle needs: DCP's metadata dataclasses and enums, torch.Size, dtypes,
    layouts, paths.
    """
    if (module, name) in _DCP_GLOBALS:
        return getattr(importlib.import_module(module), name)
    if module == "torch":
        dtype = torch.__dict__.get(name)
        return dtype if isinstance(dtype, torch.dtype) else None
    if module in _DCP_MODULES:
        found = importlib.import_module(module).__dict__.get(name)
        if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
            return found
    return None


def _dcp_record(cls: type) -> bool:
    """Whether BUILD may fill an instance of ``cls``: one of DCP's metadata dataclasses."""
    return dataclasses.is_dataclass(cls) and cls.__module__ in _DCP_MODULES


def read_dcp_metadata(directory: str | os.PathLike) -> Metadata:
    """``directory``'s DCP metadata, read by :class:`RestrictedUnpickler` and checked against the data files.

    Raises :class:`CheckpointError` naming the file: ``.metadata`` missing, damaged, refers to anything
    but DCP's metadata records or sets anything but their fields; an entry stored as bytes (it would be
    unpickled); a record of the wrong type or out of bounds (:func:`check_metadata`); a data file that is
    missing, lies outside ``directory`` or is shorter than the metadata says.
    """
    directory = Path(directory)
    file = directory / DCP_METADATA
    if not file.is_file():
        raise CheckpointError(f"{file}: missing; {directory} holds no complete DCP checkpoint")
    try:
        with open(file, "rb") as f:
            metadata = RestrictedUnpickler(f, dcp_global, _dcp_record).load()
    except Exception as exc:
        raise CheckpointError(f"{file}: damaged DCP metadata ({type(exc).__name__}: {exc})") from exc
    check_metadata(metadata, file)
    for index, info in metadata.storage_data.items():
        _check_data_file(file, directory, index.fqn, info)
    return metadata


def _bad(file: Path, field: str, value: Any, what: str) -> CheckpointError:
    return CheckpointError(
        f"{file}: {field}: {value!r:.120} is not {what}; the file is damaged or was edited"
    )


def _size(file: Path, field: str, value: Any, ndim: int | None = None) -> torch.Size:
    """``value`` if it is a ``torch.Size`` of non-negative ints (of ``ndim`` dimensions when given)."""
    ok = isinstance(value, torch.Size) and all(isinstance(n, int) and 0 <= n < MAX_NUMEL for n in value)
    if not ok or (ndim is not None and len(value) != ndim):
        raise _bad(file, field, value, f"a shape of {ndim if ndim is not None else 'any'} non-negative sizes")
    return value


def check_metadata(metadata: Any, file: Path) -> None:
    """Every record of ``metadata`` of its type and in bounds; each tensor's chunks inside it, backed by data.

    Raises :class:`CheckpointError` naming ``file`` and the field.
    """
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file}: holds a {type(metadata).__name__}, not DCP metadata")
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise _bad(file, "state_dict_metadata / storage_data", type(entries).__name__, "a mapping")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        raise _bad(file, "storage_meta", metadata.storage_meta, "DCP's StorageMeta")
    lengths: dict[tuple[str, tuple[int, ...]], int] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise _bad(file, "storage_data", index, "a MetadataIndex -> storage record")
        for name in ("offset", "length"):
            value = getattr(info, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise _bad(file, f"storage_data[{index.fqn!r}].{name}", value, "a byte count")
        offset = tuple(index.offset) if index.offset is not None else ()
        lengths[(index.fqn, offset)] = lengths.get((index.fqn, offset), 0) + info.length
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise _bad(file, "state_dict_metadata", key, "a tensor name")
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"{file}: entry {key!r} is stored as bytes, which DCP would unpickle; "
                "a Nereus checkpoint holds tensors only, so it is not loaded"
            )
        _check_tensor(file, key, entry, lengths)


def _check_tensor(file: Path, key: str, entry: TensorStorageMetadata, lengths: dict) -> None:
    """One tensor's record: a dtype, a size, chunks inside it that cover it, each backed by stored bytes."""
    props = entry.properties
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
        raise _bad(file, f"{key}.properties", props, "DCP's TensorProperties with a dtype")
    size = _size(file, f"{key}.size", entry.size)
    numel = math.prod(size)
    if numel > MAX_NUMEL:
        raise _bad(file, f"{key}.size", tuple(size), f"a tensor of at most {MAX_NUMEL} elements")
    if not isinstance(entry.chunks, list):
        raise _bad(file, f"{key}.chunks", entry.chunks, "a list of chunks")
    item = torch.empty((), dtype=props.dtype).element_size()
    covered = 0
    for i, chunk in enumerate(entry.chunks):
        where = f"{key}.chunks[{i}]"
        if not isinstance(chunk, ChunkStorageMetadata):
            raise _bad(file, where, chunk, "DCP's ChunkStorageMetadata")
        offsets = _size(file, f"{where}.offsets", chunk.offsets, len(size))
        sizes = _size(file, f"{where}.sizes", chunk.sizes, len(size))
        if any(o + n > s for o, n, s in zip(offsets, sizes, size, strict=True)):
            raise _bad(
                file, where, (tuple(offsets), tuple(sizes)), f"a chunk inside the tensor's {tuple(size)}"
            )
        stored = lengths.get((key, tuple(offsets)), 0)
        if math.prod(sizes) * item > stored:
            raise CheckpointError(
                f"{file}: {where} declares {math.prod(sizes) * item} bytes of {props.dtype} but its data "
                "files "
                f"hold {stored} for it; the metadata is damaged or was edited"
            )
        covered += math.prod(sizes)
    if covered != numel:
        raise CheckpointError(
            f"{file}: {key}: its chunks hold {covered} of its {numel} elements; the metadata is damaged or "
            "was "
            "edited"
        )


def _check_data_file(file: Path, directory: Path, key: str, info: Any) -> None:
    name = getattr(info, "relative_path", None)
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise CheckpointError(f"{file}: entry {key!r} points at {name!r}, not at a file of {directory}")
    data = directory / name
    if data.is_symlink() or not data.is_file():
        what = (
            "a symbolic link; a checkpoint is read from its own files only"
            if data.is_symlink()
            else "missing"
        )
        raise CheckpointError(f"{data}: {what} (it holds {key!r})")
    size, needed = data.stat().st_size, int(info.offset) + int(info.length)
    if size < needed:
        raise CheckpointError(
            f"{data}: truncated: {size} bytes, the checkpoint's metadata needs {needed} (for {key!r})"
        )
