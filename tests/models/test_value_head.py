"""Value models (critic, reward model): a ``score`` head replaces the LM head, sharded like the final norm."""

from __future__ import annotations

import pytest
import torch

from nereus_lightning.emu.schema import StateSchema
from nereus_lightning.lightning.roles import build_value_model
from nereus_lightning.models import MicroBatch, ShardedCausalLM, forward_logits, placement, train_step
from nereus_lightning.models.sharded import has_value_head
from nereus_lightning.models.sharding import pp_stages, tp_slices
from nereus_lightning.plan.layout import Layout
from nereus_lightning.testing.tiny import VOCAB, my_replica, rel_err, tiny_config

LAYOUTS = [(2, 1), (1, 2), (2, 2)]


def _value_model():
    model = build_value_model(tiny_config("gqa_tied"), seed=5)  # tied config: a value model unties it
    with torch.no_grad():
        model.score.bias.fill_(0.3)
    return model


def test_value_model_is_token_classification_with_one_label() -> None:
    model = _value_model()
    names = [n for n, _ in model.named_parameters()]
    assert names[-2:] == ["score.weight", "score.bias"] and not any(n.startswith("lm_head") for n in names)
    assert has_value_head(model.config) and not model.config.tie_word_embeddings
    assert model.score.weight.shape == (1, model.config.hidden_size)
    p = placement("score.weight")
    assert (p.kind, p.tp_dim) == ("value_head", None)
    assert pp_stages(p, num_layers=4, pp=2) == (1,)  # the last stage, replicated over TP
    # The EMU schema read from the config alone agrees with the model's parameters.
    assert StateSchema.of(model.config).names == StateSchema.of(model.config, model).names


def _sharded_value_errors(rank: int, world: int) -> dict[str, float]:
    model = _value_model()
    ids = torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(3))
    target = torch.randn(4, 9, generator=torch.Generator().manual_seed(4))
    ref_values = model(ids).logits
    loss = ((ref_values[..., 0] - target) ** 2).mean()
    loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    out: dict[str, float] = {}
    for tp, pp in LAYOUTS:
        _, comm = my_replica(rank, world, Layout(tp, pp), tied=False)
        unit = ShardedCausalLM.from_model(model, comm)
        values = forward_logits(unit, MicroBatch(ids), where="all")
        out[f"tp{tp}pp{pp}/values"] = rel_err(values, ref_values.detach())
        # Every replica trains on the same batch, so the DP average is the single-replica gradient.
        train_step(unit, [MicroBatch(ids)], lambda v, mb: ((v - target) ** 2).mean())
        worst = 0.0
        for name, param in unit.named_parameters():
            full = ref_grads[name]
            want = full[tp_slices(tuple(full.shape), placement(name), tp, comm.tp_rank)]
            worst = max(
                worst, rel_err(param.grad, want) if want.abs().max() > 0 else float(param.grad.abs().max())
            )
        out[f"tp{tp}pp{pp}/grads"] = worst
    return out


def test_sharded_value_model_matches_unsharded(dist4) -> None:
    for rank, errors in enumerate(dist4.run(_sharded_value_errors)):
        assert len(errors) == 2 * len(LAYOUTS)
        for key, err in errors.items():
            assert err <= 1e-5, f"rank {rank} {key}: relative error {err:.2e}"


def test_token_log_probs_of_a_value_model_are_refused() -> None:
    from nereus_lightning.models import ReplicaComm, token_logprobs
    from nereus_lightning.spec.errors import NereusConfigError

    unit = ShardedCausalLM.from_model(_value_model(), ReplicaComm.single())
    with pytest.raises(NereusConfigError, match="value model"):
        token_logprobs(unit, torch.zeros(1, 3, dtype=torch.long))
