"""Fixtures of the vLLM tests: the job folder, and two gloo ranks that keep their vLLM import across tests."""

from __future__ import annotations

import os

import pytest

from nereus_lightning.engines.vllm_engine import INSTALL, vllm_available

#: Every vLLM test carries this: marked ``vllm`` (``nox -s vllm`` runs them) and skipped where vllm is
#: missing.
VLLM = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not vllm_available(), reason=f"vllm is not installed ({INSTALL}; or run `nox -s vllm`)"
    ),
]

if vllm_available():
    # Imported once here: the ranks nereus-train forks inherit it (vLLM takes ~30 s to import on 2 cores).
    from nereus_lightning.engines.vllm_engine import _import_vllm

    _import_vllm()


@pytest.fixture(scope="session")
def job(tmp_path_factory):
    """The user's files: a tiny Qwen2 folder vLLM runs (head_dim 64, fp32) and train prompts."""
    from tests.helpers import word_problem_job
    from tests.vllm.helpers import MODEL, VOCAB

    return word_problem_job(str(tmp_path_factory.mktemp("vllm_job")), VOCAB, **MODEL)


@pytest.fixture(scope="session")
def dist2_vllm():
    """Two gloo ranks for engine tests, with collective timeouts long enough for vLLM's start."""
    from nereus_lightning.testing import WorkerPool

    os.environ.setdefault("NEREUS_PG_TIMEOUT", "600")
    pool = WorkerPool(2, timeout=900)
    yield pool
    pool.close()
