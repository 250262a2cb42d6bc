"""The CUDA sources hipify cleanly, and the committed ROCm copies in ``nereus_lightning/hip`` are in step."""

from __future__ import annotations

import pytest

from nereus_lightning.kernels import hipify


@pytest.fixture(scope="module")
def hipified() -> dict[str, str]:
    return hipify.hipify_sources()


def test_every_cuda_source_hipifies_without_cuda_leftovers(hipified):
    assert set(hipified) == {"pack_kernels.hip", "pack_kernels.cuh", "pack_host.cpp"}
    for name, text in hipified.items():
        assert hipify.leftovers(text) == [], name
    assert "hipLaunchKernelGGL" in hipified["pack_kernels.hip"]


def test_committed_hip_copies_are_in_step_with_cuda(hipified):
    for name, text in hipified.items():
        committed = (hipify.HIP_DIR / name).read_text()
        assert committed == text, f"hip/{name} is stale: run `python -m nereus_lightning.kernels.hipify`"


def test_leftover_detector_catches_a_glued_launch():
    assert hipify.leftovers("elsehipLaunchKernelGGL((k), dim3(1))") != []
    assert hipify.leftovers("k<<<1, 2>>>(x); cudaMemcpy(a, b, n);") == ["<<<", "cudaMemcpy("]
