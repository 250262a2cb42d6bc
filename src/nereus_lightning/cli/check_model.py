"""`nereus-check-model`: does the body compute a model family exactly? A self-check users can run.

Example::

    nereus-check-model model=hf model.config=/path/to/config.json

A registered family (``spec.families``) runs :func:`nereus_lightning.proof.selfcheck.check_model`
and prints the max error per layout and check. Any other family is put to the proof
(:func:`nereus_lightning.proof.admission.admit`): logits, log-probs and gradients at TP1/2 x
PP1/2 and the unit state through Split/Merge; its verdict is cached per model type, transformers
version and layout, and admits it to every entry point (``spec.families.family_of``) when exact.
Refuses, before any process starts, a config whose TP styles or architecture the body cannot build.
Exit status 0 when every error is within ``tolerance``, 1 when one is not, 2 on bad input.
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
    from nereus_lightning.proof.selfcheck import check_model
    from nereus_lightning.spec.families import FAMILIES, family_of
    from nereus_lightning.spec.verdicts import on_trial

    world = int(cfg.world_size)
    require(world in (1, 2, 4), "world_size", f"must be 1, 2 or 4, got {world}")
    config = load_config(str(cfg.model.config))
    with on_trial(config.model_type):
        family_of(config)  # TP styles and architecture refused before any process starts
    if config.model_type in FAMILIES:
        return check_model(config, world)
    return admission_errors(config, world)


def admission_errors(config: Any, world: int) -> dict[str, float]:
    """Admit an unregistered family by proof (cached); the worst error per layout, printed with any reason."""
    from nereus_lightning.proof.admission import admit
    from nereus_lightning.spec.verdicts import cache_file

    require(
        world == 4,
        "world_size",
        f"admitting a new family checks TP2 x PP2 and Split/Merge: needs 4, got {world}",
    )
    verdict = admit(config, world_size=world)
    assert verdict is not None  # unregistered
    print(
        f"{verdict.model_type}: not in the registry; admission by proof ({verdict.seconds:.1f} s, "
        f"verdict cached in {cache_file()})"
    )
    for layout, v in verdict.layouts.items():
        if not v.exact:
            print(f"{layout}: {v.reason}")
    return {
        f"{layout}/worst": (v.max_error if v.exact else float("inf")) for layout, v in verdict.layouts.items()
    }


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
