"""A model vLLM cannot run here is refused when the module is built, before any rank starts."""

from __future__ import annotations

import pytest

from nereus_lightning.spec.errors import NereusConfigError
from tests.vllm.conftest import VLLM

pytestmark = VLLM


def test_a_head_size_the_cpu_attention_lacks_is_refused_naming_the_sizes_it_has():
    from nereus_lightning import GRPOModule

    with pytest.raises(
        NereusConfigError, match=r"actor: head_dim=16: vLLM's CPU attention runs head sizes \[.*64"
    ):
        GRPOModule(actor="tiny_llama", rollout_engine="vllm")  # the preset's head_dim is 16
