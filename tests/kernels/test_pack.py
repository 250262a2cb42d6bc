"""pack/unpack: the torch reference against an independent byte oracle (CPU), the fused kernels
against the reference bit for bit (GPU), poisoned buffers so unwritten bytes show."""

from __future__ import annotations

import random

import pytest
import torch

from nereus_lightning.kernels import (
    _ext,
    byte_offsets,
    kernel_status,
    pack,
    pack_reference,
    unpack,
    unpack_reference,
)
from tests.kernels.views import POISON, as_bytes, poisoned_like, random_views

gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA/ROCm GPU (the fused kernels); CPU runs the reference tests",
)


def _expected_buffer(views: list[torch.Tensor]) -> torch.Tensor:
    offsets, total = byte_offsets(views)
    out = torch.full((total,), POISON, dtype=torch.uint8)
    for view, offset in zip(views, offsets, strict=True):
        data = as_bytes(view.cpu())
        out[offset : offset + data.numel()] = data
    return out


# ---------------------------------------------------------------- reference (CPU)


def test_byte_offsets_align_every_slot_to_16_bytes():
    views = [
        torch.zeros(3, dtype=torch.bfloat16),
        torch.zeros(0),
        torch.zeros(5, dtype=torch.float64),
        torch.zeros(1, dtype=torch.int8),
    ]
    offsets, total = byte_offsets(views)
    assert offsets == [0, 16, 16, 64]
    assert total == 80


@pytest.mark.parametrize("n, seed", [(1, 0), (5, 1), (40, 2), (300, 3), (5000, 4)])
def test_reference_pack_matches_byte_oracle_and_leaves_padding(n, seed):
    views = random_views(random.Random(seed), n, writable=False)
    _, total = byte_offsets(views)
    out = torch.full((total + 7,), POISON, dtype=torch.uint8)
    assert pack(views, out) is out
    # Every slot byte written with the view's bytes; padding between slots and the tail untouched.
    assert torch.equal(out[:total], _expected_buffer(views))
    assert bool((out[total:] == POISON).all())


@pytest.mark.parametrize("n, seed", [(1, 10), (7, 11), (60, 12), (5000, 13)])
def test_reference_unpack_writes_exactly_the_views(n, seed):
    sources = random_views(random.Random(seed), n, writable=True)
    buffer = pack(sources)
    targets = [poisoned_like(src) for src in sources]
    before = [parent.clone() for parent, _ in targets]
    unpack(buffer, [dst for _, dst in targets])
    for src, (parent, dst), old in zip(sources, targets, before, strict=True):
        assert torch.equal(as_bytes(dst), as_bytes(src))
        # Bytes of the parent outside the view keep their poison.
        inside = torch.zeros(parent.numel() // dst.element_size(), dtype=torch.bool)
        if dst.numel():
            inside.as_strided(dst.shape, dst.stride(), dst.storage_offset()).fill_(True)
        mask = ~inside.repeat_interleave(dst.element_size())
        assert torch.equal(parent[mask], old[mask])


def test_round_trip_restores_column_blocks_of_parameters():
    weight = torch.randn(64, 96, dtype=torch.bfloat16)
    norm = torch.randn(96, dtype=torch.float32)
    views = [weight[:, 32:64], weight[16:48], norm, weight.t()[5:9]]
    buffer = pack(views)
    copies = [torch.empty_like(v) for v in views]
    unpack(buffer, copies)
    for v, c in zip(views, copies, strict=True):
        assert torch.equal(v, c)


def test_pack_allocates_on_the_views_device_and_empty_list():
    assert pack([]).numel() == 0
    out = pack([torch.ones(3)])
    assert out.dtype == torch.uint8 and out.numel() == 16 and out.device.type == "cpu"


def test_bad_buffers_are_rejected_before_any_write():
    views = [torch.ones(8)]
    with pytest.raises(ValueError, match="at least 32 bytes"):
        pack(views, torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="1-D uint8"):
        pack(views, torch.zeros(32, dtype=torch.float32))
    target = torch.full((8,), 7.0)
    with pytest.raises(ValueError, match="at least 32 bytes"):
        unpack(torch.zeros(31, dtype=torch.uint8), [target])
    assert bool((target == 7.0).all())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU fallback is observable only without a GPU")
def test_without_gpu_the_kernels_report_why():
    loaded, reason = kernel_status()
    assert not loaded
    assert "no GPU" in reason or "NEREUS_PACK_KERNELS=0" in reason


# ---------------------------------------------------------------- fused kernels (GPU)


def _kernel_pack(views, chunk_bytes):
    _, total = byte_offsets(views)
    out = torch.full((total + 16,), POISON, dtype=torch.uint8, device="cuda")
    assert _ext.copy_views(views, out, pack=True, chunk_bytes=chunk_bytes), "kernel declined a plain case"
    return out


@pytest.mark.gpu
@gpu
def test_kernels_load_on_gpu():
    loaded, reason = kernel_status()
    assert loaded, reason


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n, seed", [(1, 20), (3, 21), (64, 22), (1000, 23), (5000, 24)])
@pytest.mark.parametrize("chunk_bytes", [1024, 65536])
def test_kernel_pack_is_bit_exact(n, seed, chunk_bytes):
    views = random_views(random.Random(seed), n, device="cuda", writable=False)
    got = _kernel_pack(views, chunk_bytes)
    want = torch.full_like(got, POISON)
    pack_reference(views, want)
    assert torch.equal(got, want)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n, seed", [(1, 30), (5, 31), (200, 32), (5000, 33)])
@pytest.mark.parametrize("chunk_bytes", [1024, 65536])
def test_kernel_unpack_is_bit_exact(n, seed, chunk_bytes):
    sources = random_views(random.Random(seed), n, device="cuda", writable=True)
    buffer = pack_reference(sources)
    mine = [poisoned_like(src) for src in sources]
    ref_parents = [parent.clone() for parent, _ in mine]
    ref_views = [
        p.view(d.dtype).as_strided(d.shape, d.stride(), d.storage_offset())
        for p, (_, d) in zip(ref_parents, mine, strict=True)
    ]
    assert _ext.copy_views([d for _, d in mine], buffer, pack=False, chunk_bytes=chunk_bytes)
    unpack_reference(buffer, ref_views)
    for (parent, _), ref_parent in zip(mine, ref_parents, strict=True):
        assert torch.equal(parent, ref_parent)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("chunk_bytes", [1024, 65536])
def test_kernel_long_rows_short_rows_and_large_views(chunk_bytes):
    g = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(64, 40000, device="cuda", generator=g).to(torch.bfloat16)
    emb = torch.randn(3000, 512, device="cuda", generator=g).to(torch.bfloat16)
    x3 = torch.randn(6, 50, 70, device="cuda", generator=g)
    views = [
        w[:, 8:39992],
        w[:, 3:11],
        w[5:60],
        emb,
        emb[:, 256:],
        x3[:, 1:40, 2:66],
        x3.permute(2, 0, 1)[3:],
    ]
    got = _kernel_pack(views, chunk_bytes)
    want = torch.full_like(got, POISON)
    pack_reference(views, want)
    assert torch.equal(got, want)
    copies = [torch.full_like(v, float("nan")) for v in views]
    unpack(got, copies)
    for v, c in zip(views, copies, strict=True):
        assert torch.equal(v, c)


@pytest.mark.gpu
@gpu
def test_pack_unpack_dispatch_to_the_kernel_and_round_trip():
    rng = random.Random(40)
    views = random_views(rng, 300, device="cuda", writable=True)
    buffer = pack(views)  # out=None: fresh torch.empty, so only the slots (not the padding) are defined
    assert buffer.is_cuda
    want = pack_reference([v.cpu() for v in views])
    offsets, _ = byte_offsets(views)
    for v, offset in zip(views, offsets, strict=True):
        nbytes = v.numel() * v.element_size()
        assert torch.equal(buffer[offset : offset + nbytes].cpu(), want[offset : offset + nbytes])
    copies = [poisoned_like(v)[1] for v in views]
    unpack(buffer, copies)
    for v, c in zip(views, copies, strict=True):
        assert torch.equal(as_bytes(v), as_bytes(c))


@pytest.mark.gpu
@gpu
def test_kernel_declines_what_it_cannot_reproduce_and_the_reference_runs():
    z = torch.randn(8, 8, dtype=torch.complex64, device="cuda")
    out = torch.empty(1024, dtype=torch.uint8, device="cuda")
    assert not _ext.copy_views([z.conj()], out, pack=True)
    buf = pack([z.conj()])
    assert torch.equal(buf.cpu(), pack_reference([z.conj().cpu()]))
    leaf = torch.zeros(4, device="cuda", requires_grad=True)
    assert not _ext.copy_views([leaf], out, pack=False)
