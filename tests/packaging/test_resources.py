"""The folders beside the code (configs/, cuda/, hip/) are found; pyproject ships them and every package."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest

from nereus_lightning._resources import RESOURCES, resource_dir
from nereus_lightning.cli._hydra import CONFIG_ROOT, compose
from nereus_lightning.kernels import hipify
from nereus_lightning.kernels._ext import CUDA_DIR, HEADERS, SOURCES

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+ (tomllib)")

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_hydra_apps_find_their_configs():
    assert CONFIG_ROOT == resource_dir("configs")
    for name in (
        "train.yaml",
        "simulate.yaml",
        "export.yaml",
        "plan/plan.yaml",
        "check_model/check_model.yaml",
    ):
        assert (CONFIG_ROOT / name).is_file(), name
    assert compose(CONFIG_ROOT, "train", ["experiment=quick"]).trainer.max_steps > 0


def test_the_kernel_loader_finds_the_cuda_and_hip_sources():
    assert CUDA_DIR == resource_dir("cuda")
    assert all((CUDA_DIR / name).is_file() for name in (*SOURCES, *HEADERS))
    assert hipify.HIP_DIR == resource_dir("hip")
    assert (hipify.HIP_DIR / "pack_kernels.hip").is_file()


def test_an_unknown_resource_names_the_shipped_ones():
    with pytest.raises(ValueError, match="configs, cuda, hip"):
        resource_dir("kernels")


def test_pyproject_lists_every_package_of_src_and_of_the_resource_folders():
    found = {
        ".".join(init.parent.relative_to(ROOT / "src").parts) for init in (ROOT / "src").rglob("__init__.py")
    }
    for name in RESOURCES:
        found |= {
            ".".join(("nereus_lightning", *init.parent.relative_to(ROOT).parts))
            for init in (ROOT / name).rglob("__init__.py")
        }
    assert set(SETUPTOOLS["packages"]) == found


def test_pyproject_maps_each_resource_folder_to_the_repository_root_and_ships_all_its_files():
    package_dir = SETUPTOOLS["package-dir"]
    for name in RESOURCES:
        package = f"nereus_lightning.{name}"
        assert package_dir[package] == name
        # setuptools globs each pattern (recursively) inside the package's folder; .py files ship as modules.
        shipped = {
            Path(hit)
            for pattern in SETUPTOOLS["package-data"][package]
            for hit in glob.glob(str(ROOT / name / pattern), recursive=True)
        }
        files = {p for p in (ROOT / name).rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")}
        assert files - shipped == set()
        assert len(files) > 1
