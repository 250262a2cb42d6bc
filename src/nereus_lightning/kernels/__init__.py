"""Fused kernels with a torch reference as their contract: pack / unpack of many strided slices into
one flat buffer, and per-row log-softmax statistics (and their gradient) of vocabulary-sharded logits."""

from nereus_lightning.kernels._ext import kernel_status
from nereus_lightning.kernels.pack import byte_offsets, pack, pack_reference, unpack, unpack_reference
from nereus_lightning.kernels.softmax_stats import (
    combine_stats,
    finish_stats,
    logit_grad,
    logit_grad_reference,
    rescale_stats,
    row_stats,
    row_stats_reference,
)

__all__ = [
    "byte_offsets",
    "combine_stats",
    "finish_stats",
    "kernel_status",
    "logit_grad",
    "logit_grad_reference",
    "pack",
    "pack_reference",
    "rescale_stats",
    "row_stats",
    "row_stats_reference",
    "unpack",
    "unpack_reference",
]
