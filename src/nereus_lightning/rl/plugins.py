"""User code named in a config: a ``.py`` file or an importable module, and an attribute of it.

One import rule for every plug-in (reward functions, algorithms): a file is imported once per
process under a name derived from its absolute path, so a job's ranks and worker processes that
import the same file get the same objects again.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

from nereus_lightning.spec.errors import NereusConfigError


def import_source(path: str, key: str) -> ModuleType:
    """Import a ``.py`` file or a module by its dotted name; errors name the config ``key``."""
    if not (path.endswith(".py") or os.path.sep in path):
        try:
            return importlib.import_module(path)
        except Exception as exc:
            raise NereusConfigError(
                f"{key}: cannot import module {path!r}: {type(exc).__name__}: {exc}"
            ) from exc
    if not os.path.isfile(path):
        raise NereusConfigError(f"{key}: {path!r} does not exist")
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
    module_name = f"nereus_plugin_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise NereusConfigError(f"{key}: {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise NereusConfigError(f"{key}: importing {path!r} failed: {type(exc).__name__}: {exc}") from exc
    return module


def load_attribute(reference: str, key: str) -> Any:
    """The object ``reference`` names: ``file.py:name`` or ``package.module:name``."""
    path, sep, name = reference.rpartition(":")
    if not sep or not path or not name:
        raise NereusConfigError(
            f"{key}: {reference!r} names no object; write 'file.py:name' or 'module:name'"
        )
    module = import_source(path, key)
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise NereusConfigError(f"{key}: {path!r} has no {name!r}; it defines {public}")
    return getattr(module, name)
