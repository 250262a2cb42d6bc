"""Where the folders that ship beside the code live: ``configs/`` (the Hydra apps' configs), ``cuda/``
and ``hip/`` (the pack/unpack kernel sources).

In the repository they sit at the root, beside ``src/``; the wheel carries them inside the package
(``nereus_lightning/configs`` and so on: pyproject's ``package-dir`` maps each to its root folder).
Each is a package (it has an ``__init__.py``), which is what tells a real copy from a stale folder
(a ``__pycache__`` left behind) and lets ``importlib.resources`` find it in wheels and editable installs.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
RESOURCES = ("configs", "cuda", "hip")


def resource_dir(name: str) -> Path:
    """The folder ``name`` (one of ``RESOURCES``): in the installed package, else at the repository root."""
    if name not in RESOURCES:
        raise ValueError(f"unknown resource folder {name!r}; the shipped folders are {', '.join(RESOURCES)}")
    installed = PACKAGE_DIR / name
    # A source tree (editable install, or src/ on PYTHONPATH) keeps the folder at the repository root.
    return installed if (installed / "__init__.py").is_file() else PACKAGE_DIR.parent.parent / name
