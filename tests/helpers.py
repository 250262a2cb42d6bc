"""What tests of several folders share: hand-built plans, ``nereus-train`` as a user starts it, a user's job.

The gloo worker pool, the tiny models and their tolerance (``rel_err``) are shipped with the package
(``nereus_lightning.testing``); the pool fixtures are in ``tests/conftest.py``. What only one folder's
tests use stays in that folder (``tests/<folder>/helpers.py`` and the like).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.spec.workload import workflow

#: What launchers set; a test starts ``nereus-train`` from a shell without them (earlier tests of this
#: session may have set some).
LAUNCH_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def cand(tp: int, pp: int, gpus: Sequence[int]) -> Candidate:
    """``len(gpus) / (tp * pp)`` replicas of TP x PP on ``gpus``."""
    gpus = tuple(gpus)
    return Candidate(Layout(tp, pp), len(gpus) // (tp * pp), gpus)


def plan(algorithm: str = "ppo", **stages: Candidate) -> Plan:
    """A plan of the given model-stages of ``algorithm``, in workflow order."""
    return Plan.of({ms.name: stages[ms.name] for ms in workflow(algorithm) if ms.name in stages})


def is_launch_variable(key: str) -> bool:
    """Whether environment variable ``key`` is one a launcher (torchrun, SLURM) sets."""
    return key.startswith(("TORCHELASTIC", "SLURM_")) or key in LAUNCH_VARIABLES


def launch_env() -> dict[str, str]:
    """This process's environment without launcher variables, one thread per rank, no plot window."""
    env = {k: v for k, v in os.environ.items() if not is_launch_variable(k)}
    return {**env, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", "COLUMNS": "200"}


def nereus_train(
    out: Path, *overrides: str, cwd: Path | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """``nereus-train`` as a user starts it on one machine (stdout and stderr together, not a terminal).

    Its Hydra run folder is ``out``; with ``check`` a non-zero exit fails the test with the output's tail.
    """
    done = subprocess.run(
        [sys.executable, "-m", "nereus_lightning.cli.train", f"hydra.run.dir={out}", *overrides],
        cwd=cwd,
        env=launch_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert not check or done.returncode == 0, done.stdout[-3000:]
    return done


def word_problem_job(root: str | os.PathLike, vocab_size: int, **shape: Any) -> dict[str, Any]:
    """A user's job under ``root``: a tiny Qwen2 folder (tokenizer trained on the prompts) and train prompts.

    ``shape`` overrides the model's config fields. Returns the folder (``model``), the train parquet
    (``train``) and its rows (``rows``).
    """
    from nereus_lightning.rl.wordproblems import make_rows, write_parquet
    from nereus_lightning.testing.folders import tiny_model_folder

    rows = make_rows(64, "train")
    texts = [r["prompt"][0]["content"] + " " + r["extra_info"]["answer"] for r in rows]
    model = tiny_model_folder(
        os.path.join(root, "model"), texts, family="qwen2", vocab_size=vocab_size, **shape
    )
    return {"model": model, "train": write_parquet(rows, os.path.join(root, "train.parquet")), "rows": rows}
