"""`nereus-check-model`: does the body compute a model family exactly? A self-check users can run.

Example::

    nereus-check-model model=hf model.config=/path/to/config.json

Refuses a family outside the registry (``spec.families``) with the reason; otherwise runs
:func:`nereus_lightning.models.selfcheck.check_model` and prints the max error per layout and
check. Exit status 0 when every error is within ``tolerance``, 1 when one is not, 2 on bad input.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import hydra
from omegaconf import DictConfig

from nereus_lightning.cli._hydra import CONFIG_ROOT, compose
from nereus_lightning.spec.errors import NereusConfigError, require

CHECK_CONFIGS = CONFIG_ROOT / "check_model"


def check_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The composed nereus-check-model config with command-line style ``overrides``."""
    return compose(CHECK_CONFIGS, "check_model", overrides)


def load_config(path: str) -> Any:
    """The transformers config at ``path`` (a config.json or its folder)."""
    from transformers import AutoConfig

    found = os.path.isfile(path) or os.path.isfile(os.path.join(path, "config.json"))
    require(found, "model.config", f"no config.json at {path!r}")
    return AutoConfig.from_pretrained(path)


def check_from_config(cfg: DictConfig) -> dict[str, float]:
    """Run the self-check a composed config describes; returns the max error per ``layout/check``."""
    from nereus_lightning.models.selfcheck import check_model
    from nereus_lightning.spec.families import family_of

    world = int(cfg.world_size)
    require(world in (1, 2, 4), "world_size", f"must be 1, 2 or 4, got {world}")
    config = load_config(str(cfg.model.config))
    family_of(config)  # refused before any process starts
    return check_model(config, world)


def render(errors: dict[str, float], tolerance: float) -> bool:
    """Print one line per layout and check; True when every error is within ``tolerance``."""
    ok = True
    for key, err in errors.items():
        within = err == 0 if key.endswith("state_diffs") else err <= tolerance
        ok &= within
        print(f"{key:28s} {err:10.2e}  {'ok' if within else 'FAIL'}")
    print("all within tolerance" if ok else f"errors above tolerance {tolerance:g}")
    return ok


@hydra.main(config_path=str(CHECK_CONFIGS), config_name="check_model", version_base=None)
def _app(cfg: DictConfig) -> None:
    try:
        errors = check_from_config(cfg)
    except NereusConfigError as exc:
        print(f"nereus-check-model: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if render(errors, float(cfg.tolerance)) else 1)


def main() -> None:
    """Console entry point (Hydra parses the command line)."""
    _app()


if __name__ == "__main__":
    main()
