"""``pip install .`` from a clone, as the README shows it: the wheel built from the clone's files goes
into a fresh virtual environment, whose ``nereus-plan``, ``nereus-simulate`` and ``nereus-train`` then
run from another folder on the configs the wheel ships.

The fresh environment finds the dependencies (torch, lightning, ...) in this one's site-packages
through a ``.pth`` file, so nothing is downloaded; ``pip check`` says they satisfy the wheel's
requirements.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers import launch_env

ROOT = Path(__file__).resolve().parents[2]
#: What the build reads from a clone (pyproject's package-dir and readme).
CLONE = ("pyproject.toml", "README.md", "src", "configs", "cuda", "hip")

pytestmark = pytest.mark.distributed  # nereus-train starts 4 gloo ranks


def _run(*args: str | Path, cwd: Path) -> str:
    env = {k: v for k, v in launch_env().items() if k != "PYTHONPATH"}  # nothing of this checkout
    done = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with the wheel of a copy of this clone installed (``pip install .`` in two steps)."""
    tmp = tmp_path_factory.mktemp("install")
    clone = tmp / "clone"
    for name in CLONE:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, clone / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            clone.mkdir(exist_ok=True)
            shutil.copy(source, clone / name)
    offline = ("-q", "--no-deps", "--no-index")
    build = ("wheel", *offline, "--no-build-isolation", "-w", tmp / "wheel", clone)
    _run(sys.executable, "-m", "pip", *build, cwd=tmp)
    fresh = tmp / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", fresh, cwd=tmp)
    python = fresh / "bin" / "python"
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp)
    ours = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (Path(site.strip()) / "dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    wheel = next((tmp / "wheel").glob("nereus_lightning-*.whl"))
    pip = (sys.executable, "-m", "pip", "--python", python)  # this pip, working on the fresh venv
    _run(*pip, "install", *offline, wheel, cwd=tmp)
    assert "No broken requirements" in _run(*pip, "check", cwd=tmp)
    return fresh


def test_the_installed_commands_run_from_another_folder(venv, tmp_path):
    where = _run(
        venv / "bin" / "python",
        "-c",
        "import nereus_lightning; print(nereus_lightning.__file__)",
        cwd=tmp_path,
    )
    assert where.startswith(str(venv))  # the installed package, not this checkout
    plan = _run(
        venv / "bin" / "nereus-plan",
        "model=llama3_8b",
        "cluster=h200x8",
        "cluster.num_gpus=8",
        "workload.algorithm=grpo",
        cwd=tmp_path,
    )
    assert "actor_train" in plan and "reward_infer" not in plan
    simulate = _run(
        venv / "bin" / "nereus-simulate",
        "trace.steps=3",
        "policies=[static]",
        "plot=false",
        "hydra.run.dir=sim",
        cwd=tmp_path,
    )
    assert "static" in simulate and (tmp_path / "sim" / "summary.md").is_file()
    train = _run(
        venv / "bin" / "nereus-train",
        "trainer.max_steps=2",
        "save_checkpoint=false",
        "plot=false",
        "hydra.run.dir=train",
        cwd=tmp_path,
    )
    assert "run summary" in train and (tmp_path / "train" / "summary.json").is_file()
