"""HostBlock: many tensors carved out of one host allocation (page-locked with one registration on CUDA)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from nereus_lightning.emu.host import ALIGN, PAGE, HostBlock

LIKE = [
    torch.randn(3, 5),
    torch.zeros((), dtype=torch.float64),
    torch.ones(7, dtype=torch.bool),
    torch.randn(2, 3).to(torch.bfloat16),
    torch.empty(0, 4),
    torch.arange(11, dtype=torch.int64),
    torch.randn(4, 6)[:, ::2],  # not contiguous: the host copy is
]


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    return start, start + t.numel() * t.element_size()


def test_a_block_holds_one_tensor_per_entry_with_its_shape_and_dtype_and_no_overlap():
    block = HostBlock(LIKE, pin=False)
    assert not block.pinned
    assert [(h.shape, h.dtype) for h in block.tensors] == [(t.shape, t.dtype) for t in LIKE]
    assert all(h.is_contiguous() for h in block.tensors)
    # Each tensor owns a storage of exactly its bytes (DCP's writer would clone a view of a larger one) ...
    assert all(h.untyped_storage().nbytes() == h.numel() * h.element_size() for h in block.tensors)
    # ... inside one mapping, aligned, disjoint.
    spans = sorted(_span(h) for h in block.tensors if h.numel())
    base, end = block._memory.data_ptr(), block._memory.data_ptr() + block._memory.numel()
    assert block._memory.numel() % PAGE == 0
    assert all(base <= start and stop <= end for start, stop in spans)
    assert all((start - base) % ALIGN == 0 for start, _ in spans)
    assert all(stop <= nxt for (_, stop), (nxt, _) in pairwise(spans))
    for host, tensor in zip(block.tensors, LIKE, strict=True):  # no write may reach another tensor
        host.copy_(tensor)
    assert all(torch.equal(h, t) for h, t in zip(block.tensors, LIKE, strict=True))


def test_a_block_holds_what_has_its_shapes_and_dtypes_in_order():
    block = HostBlock(LIKE, pin=False)
    assert block.holds([t.clone() for t in LIKE])
    assert not block.holds(LIKE[:-1])
    assert not block.holds([LIKE[1], LIKE[0], *LIKE[2:]])
    assert not block.holds([LIKE[0].double(), *LIKE[1:]])
    assert not block.holds([LIKE[0].reshape(5, 3), *LIKE[1:]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_block_is_page_locked_until_released():
    on_gpu = [t.cuda() for t in LIKE]
    block = HostBlock(on_gpu, pin=True)
    assert block.pinned and all(h.is_pinned() for h in block.tensors if h.numel())
    for host, tensor in zip(block.tensors, on_gpu, strict=True):
        host.copy_(tensor, non_blocking=True)
    torch.cuda.synchronize()
    assert all(torch.equal(h, t) for h, t in zip(block.tensors, LIKE, strict=True))
    block.release()
    assert not any(h.is_pinned() for h in block.tensors if h.numel())
    assert all(torch.equal(h, t) for h, t in zip(block.tensors, LIKE, strict=True))
