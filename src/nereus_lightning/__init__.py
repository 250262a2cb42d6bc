"""nereus-lightning: adaptive DP/TP/PP parallelism for LLM RL post-training."""

from typing import Any

__version__ = "0.1.0"

# The Lightning surface loads on first use, so that importing the brain (spec, plan, control, ...)
# does not import lightning or torch.
_LAZY = {"NereusStrategy", "NereusCallback", "PPOModule", "GRPOModule", "ReMaxModule", "RLModule"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from nereus_lightning import lightning as _lightning

        return getattr(_lightning, name)
    raise AttributeError(f"module 'nereus_lightning' has no attribute {name!r}")
