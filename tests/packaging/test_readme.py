"""The README as a user reads it: it starts with the two nox commands and the install, every Python
block is a program that runs on the CPU as written, and its generated tables are this version's."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import launch_env

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```\n", README, flags=re.S | re.M)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]


def test_the_readme_starts_with_the_two_commands_then_the_install():
    (first_lang, first), (second_lang, second) = BLOCKS[:2]
    assert README.startswith("# nereus-lightning\n\n```bash\n") and first_lang == second_lang == "bash"
    assert [line.split("   #")[0] for line in first.splitlines()] == [
        "python3 -m pip install -q nox && python3 -m nox -s train",
        "python3 -m pip install -q nox && python3 -m nox -s lint tests vllm deepspeed",
    ]
    assert [line.split("    #")[0].rstrip() for line in second.splitlines()] == [
        "python3 -m pip install .",
        "python3 -m pip install '.[vllm]'",
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_every_python_block_runs_as_written(index, tmp_path):
    """Each block alone, in a fresh interpreter and an empty folder; Lightning's tips print once."""
    done = subprocess.run(
        [sys.executable, "-c", PYTHON[index]],
        cwd=tmp_path,
        env=launch_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "Trainer.fit` stopped: `max_steps=" in done.stdout
    assert done.stdout.count("Initializing distributed") == 1  # rank 0's line, not every rank's
    for once in ("💡 Tip: For seamless cloud uploads", "LeafSpec"):  # a tip, a third-party warning
        assert done.stdout.count(once) <= 1, once


def test_there_are_python_blocks_to_run():
    assert len(PYTHON) >= 2 and all("trainer.fit(" in code for code in PYTHON)


@pytest.fixture(scope="module")
def tables():  # noqa: ANN201
    """``benchmarks/readme_tables.py`` as a module (its paper-trace run is shared by both tests)."""
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "benchmarks" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_tables_are_this_versions(tables):
    """``python benchmarks/readme_tables.py`` rewrites them (nereus-plan, nereus-simulate, verl's names,
    the simulated sweeps from their JSON)."""
    current = tables.regions(README)
    assert set(current) == set(tables.TABLES)
    stale = [name for name, body in current.items() if body != tables.TABLES[name]() + "\n"]
    assert not stale, f"stale README tables {stale}: run python benchmarks/readme_tables.py"


def test_the_results_the_simulated_tables_come_from_are_this_versions(tables):
    """The gamma sweep, ablation and variants tables are rendered from JSON (their sweeps take
    minutes); the Nereus runs they hold must be the ones this version's code gives."""
    stale = tables.stale_results()
    assert not stale, f"stale {stale}: re-run benchmarks/bench_controller.py / bench_variants.py"
