"""An actor update in packed token-budget micro-batches equals the padded one, under every loss aggregation.

Four gloo ranks: one TP2 x PP2 replica of a tiny model, the same rollout rows (prompts of different
lengths, responses of different lengths) through :func:`~nereus_lightning.lightning.batches.replica_backward`
packed (several micro-batches) and padded (one micro-batch).
"""

from __future__ import annotations

import pytest
import torch

from nereus_lightning.rl.losses import LOSS_AGG_MODES
from nereus_lightning.testing.tiny import VOCAB, my_replica, rel_err, tiny_model

pytestmark = pytest.mark.distributed


def _rollout(seed: int):  # noqa: ANN202
    from nereus_lightning.rl.batch import RolloutBatch

    gen = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = [4, 2, 3, 4, 1, 3], [6, 2, 1, 5, 6, 3]
    n, p, r = len(prompt_lens), max(prompt_lens), max(response_lens)
    prompt_mask = torch.zeros(n, p, dtype=torch.long)
    response_mask = torch.zeros(n, r, dtype=torch.long)
    for i, (a, b) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        prompt_mask[i, p - a :] = 1
        response_mask[i, :b] = 1
    batch = RolloutBatch(
        torch.randint(0, VOCAB, (n, p), generator=gen) * prompt_mask,
        prompt_mask,
        torch.randint(0, VOCAB, (n, r), generator=gen) * response_mask,
        response_mask,
        torch.arange(n),
        torch.arange(n) // 2,
    )
    batch.old_log_probs = -torch.rand(n, r, generator=gen) * 5
    batch.ref_log_probs = -torch.rand(n, r, generator=gen) * 5
    batch.advantages = torch.randn(n, r, generator=gen)
    return batch


def _update_errors(rank: int, world: int) -> dict[str, float]:
    from nereus_lightning.lightning.batches import replica_backward, response_micro_batches
    from nereus_lightning.models import ShardedCausalLM
    from nereus_lightning.plan.layout import Layout
    from nereus_lightning.rl.algorithm import RLConfig

    model = tiny_model("qwen2")
    _, comm = my_replica(rank, world, Layout(2, 2), tied=False)
    batch = _rollout(4)
    mask = batch.response_mask.float()
    errors: dict[str, float] = {}
    for mode in LOSS_AGG_MODES:
        cfg = RLConfig(algorithm="grpo", loss_agg_mode=mode, kl_loss_coef=0.1, entropy_coeff=0.01)
        normalizer, tokens = cfg.normalizer(mask), mask.sum()
        grads, losses = [], []
        for remove_padding, micro_batch in ((False, len(batch)), (True, 1)):
            unit = ShardedCausalLM.from_model(model, comm)
            if remove_padding:  # one padded row's tokens per micro-batch: several packed micro-batches
                assert len(response_micro_batches(unit, batch, micro_batch)) >= 3
            args = (cfg, normalizer, tokens, True, remove_padding)
            metrics = replica_backward(unit, batch, micro_batch, *args)
            grads.append({n: p.grad.clone() for n, p in unit.named_parameters()})
            losses.append({k: float(v) for k, v in metrics.items()})
        errors[f"{mode}/grad"] = max(rel_err(grads[1][n], grads[0][n]) for n in grads[0])
        if comm.is_last_stage and comm.tp_rank == 0:  # the reporting rank
            for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):
                scale = max(abs(losses[0][key]), 1e-6)
                errors[f"{mode}/{key}"] = abs(losses[1][key] - losses[0][key]) / scale
    return errors


def test_packed_update_equals_padded_under_every_loss_aggregation(dist4) -> None:
    results = dist4.run(_update_errors)
    assert any(len(r) > len(LOSS_AGG_MODES) for r in results), "no rank reported the loss metrics"
    for rank, errors in enumerate(results):
        for key, err in errors.items():
            assert err <= 1e-5, f"rank {rank} {key}: {err:.2e}"
