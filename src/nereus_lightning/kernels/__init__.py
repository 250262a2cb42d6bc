"""Pack / unpack of many strided slices into one flat buffer (fused GPU kernels; else the torch reference)."""

from nereus_lightning.kernels._ext import kernel_status
from nereus_lightning.kernels.pack import byte_offsets, pack, pack_reference, unpack, unpack_reference

__all__ = ["byte_offsets", "kernel_status", "pack", "pack_reference", "unpack", "unpack_reference"]
