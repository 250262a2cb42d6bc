"""The files of a checkpoint directory: its own regular files only, each recorded with its size and SHA-256.

A checkpoint's ``nereus_meta.json`` lists every file beside it with its size and content hash
(:func:`describe`); reading it back refuses a symbolic link anywhere in the directory
(:func:`own_files`), and :func:`verify` re-hashes the files and names the first that differs. Hashing
runs on threads (``hashlib`` releases the GIL on large buffers) and, on several ranks, each rank hashes a
share of the files (:func:`share`), so that a checkpoint is read about once in all.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from nereus_lightning.spec.errors import CheckpointError

HASH = "sha256"
#: Threads hashing one rank's share (SHA-NI: 1.56 GB/s on one core, 3.1 on two from the page cache; more
#: threads overlap disk reads).
HASH_THREADS = 8


@dataclass(frozen=True)
class FileRecord:
    """What the metadata says of one file: its size in bytes and its SHA-256 (hex)."""

    size: int
    sha256: str


def own_files(directory: str | os.PathLike, skip: Iterable[str] = ()) -> list[str]:
    """Every regular file under ``directory`` (relative POSIX names, sorted), ``skip`` names left out.

    Raises :class:`CheckpointError` naming the entry: a symbolic link (file or folder) anywhere under
    ``directory`` (it could make a reader read another checkpoint's file, or any file), or an entry that is
    neither a file nor a folder.
    """
    top = Path(directory)
    skipped = set(skip)
    found: list[str] = []
    for root, dirs, files in os.walk(top, followlinks=False):
        for name in sorted(dirs) + sorted(files):
            path = Path(root) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                raise CheckpointError(
                    f"{path}: a symbolic link (to {os.readlink(path)!r}); a checkpoint is read from its own "
                    "files only: replace the link by a copy of what it points to"
                )
            if name in dirs:
                continue
            if not stat.S_ISREG(mode):
                raise CheckpointError(
                    f"{path}: not a regular file; a checkpoint holds files and folders only"
                )
            relative = path.relative_to(top).as_posix()
            if relative not in skipped:
                found.append(relative)
    return sorted(found)


def file_digest(path: str | os.PathLike) -> str:
    """The SHA-256 of the regular file ``path`` (hex), read without following a symbolic link."""
    digest = hashlib.new(HASH)
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])  # releases the GIL: threads hash files at once
    return digest.hexdigest()


def digests(
    directory: str | os.PathLike, names: Sequence[str], threads: int = HASH_THREADS
) -> dict[str, str]:
    """``name -> SHA-256`` of each of ``names`` under ``directory``, hashed on ``threads`` threads."""
    if not names:
        return {}
    top = Path(directory)
    with ThreadPoolExecutor(max(1, min(threads, len(names))), thread_name_prefix="nereus-hash") as pool:
        return dict(zip(names, pool.map(lambda n: file_digest(top / n), names), strict=True))


def describe(
    directory: str | os.PathLike, names: Sequence[str], hashes: Mapping[str, str]
) -> dict[str, FileRecord]:
    """The records of ``names`` under ``directory``: their sizes (now) and the given ``hashes``."""
    top = Path(directory)
    return {name: FileRecord(os.lstat(top / name).st_size, hashes[name]) for name in names}


def share(records: Mapping[str, FileRecord], rank: int, world_size: int) -> list[str]:
    """The files rank ``rank`` of ``world_size`` hashes: the largest first, dealt round-robin."""
    by_size = sorted(records, key=lambda n: (-records[n].size, n))
    return by_size[rank::world_size]


def differing(
    directory: str | os.PathLike, records: Mapping[str, FileRecord], names: Sequence[str]
) -> list[str]:
    """Those of ``names`` whose content hash is not the recorded one (hashed on threads)."""
    found = digests(directory, names)
    return [name for name in names if found[name] != records[name].sha256]


def mismatch_error(directory: Path, meta_file: str, bad: Sequence[str], total: int) -> CheckpointError:
    """The error for files whose content differs from their record: the file, or the metadata when many do."""
    if len(bad) == 1:
        return CheckpointError(
            f"{directory / bad[0]}: damaged: its content is not what {meta_file} recorded (SHA-256 differs; "
            "changed after the save, or copied from another checkpoint): use another checkpoint"
        )
    return CheckpointError(
        f"{directory / meta_file}: does not describe the files beside it: {len(bad)} of {total} files differ "
        f"from its record (first {bad[0]}); the metadata or the files come from another checkpoint or step: "
        "use another checkpoint"
    )


def parse_records(value: object, meta: Path) -> dict[str, FileRecord]:
    """The ``files`` entry of a metadata file as records; a malformed one raises naming ``meta``."""
    if not isinstance(value, dict):
        raise CheckpointError(f"{meta}: damaged: 'files' is a {type(value).__name__}, not a mapping")
    out: dict[str, FileRecord] = {}
    for name, record in value.items():
        size = record.get("size") if isinstance(record, dict) else None
        digest = record.get(HASH) if isinstance(record, dict) else None
        if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0):
            raise CheckpointError(f"{meta}: files[{name!r}].size: {size!r} is not a size in bytes")
        if not (
            isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)
        ):
            raise CheckpointError(f"{meta}: files[{name!r}].{HASH}: {digest!r} is not a SHA-256 in hex")
        if Path(name).is_absolute() or ".." in Path(name).parts or name in ("", "."):
            raise CheckpointError(f"{meta}: lists {name!r}, a file outside the checkpoint")
        out[name] = FileRecord(size, digest)
    return out
