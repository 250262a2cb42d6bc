"""Lazy build and load of the fused pack/unpack kernels (``cuda/``; ``nereus_lightning/cuda`` in a wheel).

The extension is built through :func:`torch.utils.cpp_extension.load` on the first pack/unpack of
GPU tensors and cached by torch (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``);
the extension name carries a hash of the sources, so an edited kernel rebuilds. On a ROCm build of
torch the same call hipifies the CUDA sources (see ``hip/README.md``). Without a
GPU, with ``NEREUS_PACK_KERNELS=0``, or when the build fails, pack/unpack use the torch reference
and one line per process says why: INFO where that is the expected path (no GPU, or disabled),
WARNING where a GPU is present and the build or load failed (with the reason). Environment:
``NEREUS_PACK_KERNELS=0`` (force the reference), ``NEREUS_PACK_VERBOSE=1`` (show the compiler
commands), ``NEREUS_PACK_CHUNK_BYTES`` (bytes per block of work, a power of two >= 1024; default
8 KiB).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from nereus_lightning._resources import resource_dir

log = logging.getLogger("nereus_lightning.kernels")

CUDA_DIR = resource_dir("cuda")
SOURCES = ("pack_host.cpp", "pack_kernels.cu")
HEADERS = ("pack_kernels.cuh",)
DEFAULT_CHUNK_BYTES = 8 * 1024  # = threads x unroll x 16 B; H200 sweep: 95-98% of the copy ceiling

_lock = threading.Lock()
_module: ModuleType | None = None
_reason: str | None = None  # why the kernels are off; None while untried or loaded
_tried = False


def build(defines: Sequence[str] = (), verbose: bool = False) -> ModuleType:
    """Build (or load from torch's extension cache) the kernels; raises if the build fails.

    Args:
        defines: extra preprocessor definitions such as ``"NEREUS_PACK_UNROLL=8"`` (benchmark variants).
        verbose: print the compiler commands.
    """
    from torch.utils import cpp_extension

    files = [CUDA_DIR / name for name in (*SOURCES, *HEADERS)]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.read_bytes())
    digest.update(repr(tuple(defines)).encode())
    name = f"nereus_pack_{digest.hexdigest()[:12]}"
    source_dir = CUDA_DIR
    if torch.version.hip:
        # ROCm: load() hipifies the sources and writes the results beside them (cuda/ -> hip/); use a
        # writable copy in the extension cache so an installed, read-only package still builds.
        cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
        source_dir = cache / f"{name}_src" / "cuda"
        source_dir.mkdir(parents=True, exist_ok=True)
        for path in files:
            (source_dir / path.name).write_bytes(path.read_bytes())
    flags = ["-O3", *(f"-D{d}" for d in defines)]
    return cpp_extension.load(
        name=name,
        sources=[str(source_dir / s) for s in SOURCES],
        extra_cflags=flags,
        extra_cuda_cflags=flags,
        extra_include_paths=[str(source_dir)],
        verbose=verbose,
    )


def _load() -> ModuleType | None:
    global _module, _reason, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        level = logging.INFO  # the reference is the expected path without a GPU or when disabled
        if os.environ.get("NEREUS_PACK_KERNELS", "1") == "0":
            _reason = "disabled by NEREUS_PACK_KERNELS=0"
        elif not torch.cuda.is_available():
            _reason = "no GPU (torch.cuda.is_available() is False)"
        else:
            try:
                _module = build(verbose=os.environ.get("NEREUS_PACK_VERBOSE") == "1")
            except Exception as exc:  # any build/load failure falls back to the reference
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                _reason = f"build failed: {type(exc).__name__}: {first[:300]}"
                level = logging.WARNING
        if _reason is not None:
            log.log(level, "fused pack/unpack kernels off (%s); using the torch reference", _reason)
        return _module


def note_reference_use() -> None:
    """Called when pack/unpack run on non-GPU tensors: on a machine with no GPU, say once why."""
    if not _tried and not torch.cuda.is_available():
        _load()


def kernel_status() -> tuple[bool, str]:
    """Whether the fused kernels are loaded, and why not (loads them if a GPU is present)."""
    module = _load()
    return module is not None, "loaded" if module is not None else str(_reason)


def copy_views(
    views: Sequence[torch.Tensor], buffer: torch.Tensor, pack: bool, chunk_bytes: int | None = None
) -> bool:
    """Run the fused kernel (``pack``: views -> buffer, else buffer -> views); False if it did not run.

    False means nothing was written and the caller must use the reference: kernels unavailable, or
    a case the kernel does not reproduce bit for bit (views on another device, conjugate/negative
    views, autograd recording, more than 8 non-mergeable dims).
    """
    module = _load()
    if module is None:
        return False
    chunk = chunk_bytes or int(os.environ.get("NEREUS_PACK_CHUNK_BYTES", DEFAULT_CHUNK_BYTES))
    return bool(module.copy_views(list(views), buffer, pack, chunk))
