"""Loading the kernels: the build call, the ROCm source copy, and the one-line fallback.

The fallback logs INFO without a GPU and WARNING when a build fails.
"""

from __future__ import annotations

import logging

import pytest
import torch

from nereus_lightning.kernels import _ext, pack, pack_reference


@pytest.fixture
def fresh_loader(monkeypatch):
    """Forget any earlier load attempt for the duration of the test."""
    monkeypatch.setattr(_ext, "_tried", False)
    monkeypatch.setattr(_ext, "_module", None)
    monkeypatch.setattr(_ext, "_reason", None)
    return _ext


def _record_load(monkeypatch):
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw) or "module")
    return calls


def test_build_compiles_the_package_sources_on_cuda(monkeypatch):
    calls = _record_load(monkeypatch)
    monkeypatch.setattr(torch.version, "hip", None)
    assert _ext.build(["NEREUS_PACK_UNROLL=8"]) == "module"
    (call,) = calls
    assert call["sources"] == [str(_ext.CUDA_DIR / s) for s in _ext.SOURCES]
    assert "-DNEREUS_PACK_UNROLL=8" in call["extra_cuda_cflags"]
    assert call["name"].startswith("nereus_pack_")
    assert (
        _ext.build(["NEREUS_PACK_UNROLL=8"]) and calls[1]["name"] == call["name"]
    )  # same sources, same cache entry
    _ext.build()
    assert calls[2]["name"] != call["name"]  # other defines, other extension


def test_build_on_rocm_hipifies_a_writable_copy(monkeypatch, tmp_path):
    calls = _record_load(monkeypatch)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    _ext.build()
    (call,) = calls
    for source in call["sources"]:
        assert source.startswith(str(tmp_path)) and source.split("/")[-2] == "cuda"
    copied = tmp_path / f"{call['name']}_src" / "cuda" / "pack_kernels.cu"
    assert copied.read_bytes() == (_ext.CUDA_DIR / "pack_kernels.cu").read_bytes()


def test_failed_build_falls_back_with_one_warning(fresh_loader, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'nereus_pack': nvcc not found")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_ext, "build", broken)
    with caplog.at_level(logging.WARNING, logger="nereus_lightning.kernels"):
        loaded, reason = _ext.kernel_status()
        assert not _ext.copy_views([torch.ones(3)], torch.empty(16, dtype=torch.uint8), pack=True)
        _ext.kernel_status()
    assert not loaded and reason.startswith("build failed: RuntimeError: Error building extension")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "torch reference" in warnings[0].getMessage()


def test_disabled_by_environment(fresh_loader, monkeypatch):
    monkeypatch.setenv("NEREUS_PACK_KERNELS", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _ext.kernel_status() == (False, "disabled by NEREUS_PACK_KERNELS=0")
    views = [torch.arange(6.0).view(2, 3)[:, 1:]]
    assert torch.equal(pack(views), pack_reference(views))


def test_no_gpu_says_so_once_at_info(fresh_loader, monkeypatch, caplog):
    monkeypatch.delenv("NEREUS_PACK_KERNELS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.DEBUG, logger="nereus_lightning.kernels"):
        _ext.note_reference_use()
        _ext.note_reference_use()
        assert _ext.kernel_status() == (False, "no GPU (torch.cuda.is_available() is False)")
    lines = [r for r in caplog.records if r.name == "nereus_lightning.kernels"]
    assert [r.levelno for r in lines] == [logging.INFO] and "torch reference" in lines[0].getMessage()
