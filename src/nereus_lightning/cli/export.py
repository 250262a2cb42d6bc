"""``nereus-export``: Hugging Face folders of a checkpoint's trainable models (for ``from_pretrained``).

nereus-export ckpt_path=outputs/<run>/checkpoints/last.ckpt output=exported

It trusts nothing in the checkpoint (see :func:`~nereus_lightning.lightning.hf_export.export_hf`): every file
is verified against its recorded SHA-256 first, no symbolic link is followed out of it, a config of an
unregistered family or with custom code is refused before transformers reads it, and nothing is written
outside ``output``. Any failure is one line, ``nereus-export: <what and the way out>`` (exit status 2);
``NEREUS_DEBUG=1`` adds the traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

from nereus_lightning.cli._hydra import CONFIG_ROOT
from nereus_lightning.spec.errors import CheckpointError, NereusConfigError


def export(ckpt_path: str, output: Any) -> dict[str, str]:
    """The folders written for ``nereus-export ckpt_path=... output=...`` (``output`` required)."""
    from nereus_lightning.lightning.hf_export import export_hf

    if not output:
        raise NereusConfigError(
            "output: not given; name the folder to write the models into (output=<folder>); nothing is "
            "written into the checkpoint"
        )
    return export_hf(str(ckpt_path), str(output))


def main() -> None:
    """The ``nereus-export`` entry point (Hydra)."""
    import hydra
    from omegaconf import DictConfig

    @hydra.main(version_base="1.3", config_path=str(CONFIG_ROOT), config_name="export")
    def _main(cfg: DictConfig) -> None:
        try:
            done = export(str(cfg.ckpt_path), cfg.output)
        except (NereusConfigError, CheckpointError) as exc:  # a bad path or config; a damaged checkpoint
            _fail(str(exc).splitlines()[0])
        except Exception as exc:  # anything else, still one line
            _fail(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
        for role, folder in done.items():
            print(f"{role}: {folder}")

    _main()


def _fail(message: str) -> None:
    """Print ``nereus-export: <message>`` (and the traceback with ``NEREUS_DEBUG=1``); exit with status 2."""
    if os.environ.get("NEREUS_DEBUG"):
        traceback.print_exc()
    print(f"nereus-export: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
