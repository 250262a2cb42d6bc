"""``nereus-export``: Hugging Face folders of a checkpoint's trainable models (for ``from_pretrained``).

nereus-export ckpt_path=outputs/<run>/checkpoints/last.ckpt output=exported
"""

from __future__ import annotations

import sys

from nereus_lightning.cli._hydra import CONFIG_ROOT
from nereus_lightning.spec.errors import CheckpointError, NereusConfigError


def main() -> None:
    """The ``nereus-export`` entry point (Hydra)."""
    import hydra
    from omegaconf import DictConfig

    @hydra.main(version_base="1.3", config_path=str(CONFIG_ROOT), config_name="export")
    def _main(cfg: DictConfig) -> None:
        from nereus_lightning.lightning.export import export_hf

        try:
            done = export_hf(str(cfg.ckpt_path), cfg.output and str(cfg.output))
        except (NereusConfigError, CheckpointError) as exc:  # a bad path or config; a damaged checkpoint
            print(f"nereus-export: {exc}", file=sys.stderr)
            sys.exit(2)
        for role, folder in done.items():
            print(f"{role}: {folder}")

    _main()


if __name__ == "__main__":
    main()
