"""Regenerate ``hip/`` from ``cuda/`` (the repository-root folders) with torch's hipify.

The ROCm build does the same thing itself: on a ROCm build of torch, ``cpp_extension.load`` (see
:mod:`nereus_lightning.kernels._ext`) hipifies the CUDA sources and writes the results next to them
in ``hip/``. The committed copies let reviewers read the ROCm code and let a CPU test check that
the CUDA sources still hipify cleanly and that the copies are in step. Run after editing ``cuda/``::

    python -m nereus_lightning.kernels.hipify
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from nereus_lightning._resources import resource_dir
from nereus_lightning.kernels._ext import CUDA_DIR, HEADERS, SOURCES

HIP_DIR = resource_dir("hip")
# Patterns that must not survive hipify: CUDA launch syntax, a launch glued to a keyword, CUDA runtime calls.
LEFTOVERS = (re.compile(r"<<<"), re.compile(r"\whipLaunchKernelGGL"), re.compile(r"\bcuda[A-Z]\w*\s*\("))


def hipify_sources() -> dict[str, str]:
    """The hipified text of every CUDA source and header, keyed by the file name torch gives it."""
    from torch.utils.hipify import hipify_python

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shutil.copytree(CUDA_DIR, root / "cuda", ignore=shutil.ignore_patterns("__pycache__"))
        files = [str(root / "cuda" / name) for name in (*SOURCES, *HEADERS)]
        results = hipify_python.hipify(
            project_directory=str(root),
            output_directory=str(root),
            includes=["cuda/*"],
            extra_files=files,
            is_pytorch_extension=True,
            show_detailed=False,
            show_progress=False,
        )
        out: dict[str, str] = {}
        for result in results.values():
            path = Path(result.hipified_path) if result.hipified_path else None
            if path is not None and path.exists() and path.parent.name == "hip":
                out[path.name] = path.read_text()
        return out


def leftovers(text: str) -> list[str]:
    """CUDA-only constructs left in hipified ``text`` (empty when clean)."""
    return [m.group(0) for pattern in LEFTOVERS for m in pattern.finditer(text)]


def main() -> None:
    """Write the hipified copies into ``hip/``."""
    for name, text in sorted(hipify_sources().items()):
        bad = leftovers(text)
        if bad:
            raise SystemExit(f"hipify left CUDA-only code in {name}: {bad[:5]}")
        (HIP_DIR / name).write_text(text)
        print(f"wrote {HIP_DIR / name}")


if __name__ == "__main__":
    main()
