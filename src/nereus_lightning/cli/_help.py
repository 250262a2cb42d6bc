"""``--help`` of a Hydra app: only the config groups the app composes, not every folder beside them.

Hydra's ``$APP_CONFIG_GROUPS`` lists every group under the config directory, which also holds
other apps' groups. The help template (``configs/hydra/help/``) calls the ``nereus_app_groups``
resolver on ``hydra:runtime.choices`` instead: the groups of the app's defaults list, each with
its options and the current choice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

RESOLVER = "nereus_app_groups"


def app_groups(choices: Mapping[str, Any]) -> str:
    """One line per config group the app uses: ``group=choice  (options: a, b, c)``."""
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    lines = []
    for group in sorted(g for g in choices if not (g == "hydra" or g.startswith("hydra/"))):
        options = ", ".join(sorted(loader.get_group_options(group)))
        lines.append(f"  {group}={choices[group] or 'null'}  (options: {options})")
    return "\n".join(lines)


def register_help_resolver() -> None:
    """Make ``${nereus_app_groups:...}`` available to the help template (idempotent)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, app_groups)
