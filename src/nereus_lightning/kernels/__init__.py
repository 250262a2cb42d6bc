"""Pack / unpack of many strided slices into one flat buffer (torch reference; GPU kernels when present)."""

from nereus_lightning.kernels.pack import byte_offsets, pack, unpack

__all__ = ["byte_offsets", "pack", "unpack"]
