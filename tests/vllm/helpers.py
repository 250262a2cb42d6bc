"""What the vLLM tests run: the job folder's model shape (tiny Qwen2, head_dim 64, fp32), scripted plans,
checking modules, pool functions.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from nereus_lightning.control import PlanFollower
from nereus_lightning.lightning import GRPOModule
from nereus_lightning.plan.layout import Layout, Plan
from nereus_lightning.spec.workload import workflow
from tests.helpers import cand

#: A model vLLM's CPU backend runs: head_dim 64 (hidden 128, 2 heads), 2 KV heads (TP 2 divides them),
#: a vocabulary of 320 rows (a multiple of 64: vLLM's vocabulary shards are ours).
MODEL = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 256}
VOCAB = 320
CHECKS = "NEREUS_TEST_VLLM_CHECKS"  # a folder: CheckedGRPOModule writes one JSON line per rank and step there


def plan_2ranks(gen_tp: int, gen_ranks: tuple[int, ...] = (0, 1)) -> Plan:
    """GRPO on ranks 0 and 1: the generation stage at TP ``gen_tp`` on ``gen_ranks`` (DP the rest), every
    other stage DP 2.
    """
    return Plan.of(
        {
            m.name: cand(gen_tp, 1, gen_ranks) if m.stage == "generation" else cand(1, 1, (0, 1))
            for m in workflow("grpo")
        }
    )


class ScriptedPlans(PlanFollower):
    """A controller that runs ``plans[step]`` (the last one holds): a test hook that forces layouts."""

    reason = "scripted"

    def __init__(self, plans: list[Plan]) -> None:
        super().__init__()
        self.plans = plans

    def target(self, signals: Any) -> Plan:
        """The scripted plan of ``signals.step``."""
        return self.plans[min(signals.step, len(self.plans) - 1)]


def engine_matches_training(module: Any, strategy: Any) -> dict[str, Any] | None:
    """Whether this rank's vLLM engine holds the actor's logical parameters, bit for bit (collective).

    The training unit's state is gathered to every rank; a rank of the generation stage reads its
    engine back (``collective_rpc``) and compares every tensor with its TP shard of that state.
    None on a rank outside the generation stage.
    """
    from nereus_lightning import emu
    from nereus_lightning.models.sharding import tp_slices

    logical = emu.gather_logical_state("actor_train").params
    unit = strategy.units._local("actor_gen")
    if unit is None:
        return None
    engine = module.rollout_engine(
        strategy, "actor_gen"
    )  # pushes the unit's shards when a sync made them newer
    back = engine.read_weights()
    schema, tp = unit.schema, unit.unit.layout.tp
    tp_rank = unit.unit.gpus.index(unit.rank)
    differ = sorted(
        name
        for name, full in logical.items()
        if not torch.equal(
            back.get(name, torch.empty(0)),
            full[tp_slices(tuple(full.shape), schema.placements[name], tp, tp_rank)],
        )
    )
    return {
        "tp": tp,
        "names": len(logical),
        "read_back": sorted(back) == sorted(logical),
        "differ": differ,
        "policy_version": engine.policy_version,
        "train_version": strategy.units._local("actor_train").counters.policy_version
        if strategy.units._local("actor_train") is not None
        else None,
    }


class CheckedGRPOModule(GRPOModule):
    """GRPO that checks, before each step's generation, that vLLM holds the trained weights (see above)."""

    def generate(self, strategy, prompts, max_new, step, greedy=False, with_greedy=False, first_index=0):  # noqa: ANN001, ANN201
        record = engine_matches_training(self, strategy)
        out = super().generate(strategy, prompts, max_new, step, greedy, with_greedy, first_index)
        folder = os.environ.get(CHECKS)
        if folder and record is not None:
            record["batch_versions"] = None if out.versions is None else sorted(set(out.versions.tolist()))
            with open(os.path.join(folder, f"rank{strategy.global_rank}.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, **record}) + "\n")
        return out


# ---- pool functions -------------------------------------------------------------------------
def engine_against_hf(
    rank: int,
    world_size: int,
    folder: str,
    variants: tuple[tuple[str, tuple[tuple[int, ...], ...], bool], ...],
) -> dict[str, dict[str, Any]]:
    """Per ``(name, replicas, tied)``: vLLM engines on the ranks of ``replicas`` (one per rank, each replica
    a vLLM world of its own) on a model's weights, against transformers on the same weights.

    ``tied=False``: the folder's model; ``tied=True``: a random model of its config with the LM head tied to
    the embedding. A rank outside the replicas reports that it holds no engine.
    """
    import transformers as tf

    from nereus_lightning.emu.schema import StateSchema
    from nereus_lightning.engines.base import sample_seeds
    from nereus_lightning.engines.hf import HFGenerateEngine
    from nereus_lightning.engines.vllm_engine import VLLMEngine, build_engine
    from nereus_lightning.models.sharded import shard_state
    from nereus_lightning.rl.forward import response_log_probs
    from nereus_lightning.rl.tokenizer import pad_ids
    from nereus_lightning.spec.workload import GenerationEngine

    pad = 0
    prompts = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44, 45], [100, 3], [7] * 9, [250, 251, 252]]
    ids, mask = pad_ids(prompts, pad, "left")
    seeds = sample_seeds(7, 0, range(len(prompts)))
    out: dict[str, dict[str, Any]] = {}
    for name, replicas, tied in variants:
        if tied:
            config = tf.AutoConfig.from_pretrained(folder, tie_word_embeddings=True)
            torch.manual_seed(1)
            hf = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        else:
            hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        config, schema = hf.config, StateSchema.of(hf.config, hf)
        greedy_hf = HFGenerateEngine(hf, config.eos_token_id, pad).generate(ids, mask, 8, do_sample=False)
        instance = build_engine(config, replicas, settings=GenerationEngine("vllm", max_model_len=64))
        if instance is None:
            out[name] = {"engine": False}
            continue
        replica = next(r for r in replicas if rank in r)
        tp, tp_rank = len(replica), replica.index(rank)
        shards = shard_state(hf, config, Layout(tp, 1), 0, tp_rank)
        instance.load(shards, schema.shape_of, schema.placements, tp_rank, policy_version=5)
        back = instance.read_weights()
        want = dict(shards)
        if tied:  # the head's own kernel, read back too: it must hold the embedding
            want["lm_head.weight"] = shards["model.embed_tokens.weight"]
        engine = VLLMEngine(instance, config.eos_token_id, pad)
        greedy = engine.generate(ids, mask, 8, do_sample=False)
        sampled = engine.generate(ids, mask, 8, temperature=0.8, sample_seeds=seeds)
        halves = [
            engine.generate(ids[r], mask[r], 8, temperature=0.8, sample_seeds=seeds[r])
            for r in (slice(0, 2), slice(2, None))
        ]
        scored, _ = response_log_probs(
            hf,
            sampled.prompt_ids,
            sampled.prompt_mask,
            sampled.response_ids,
            sampled.response_mask,
            temperature=0.8,
        )
        out[name] = {
            "engine": True,
            "tp": tp,
            "greedy_equal": torch.equal(greedy.response_ids, greedy_hf.response_ids),
            "greedy": greedy.response_ids.tolist(),
            "read_back": sorted(back) == sorted(want),
            "names": sorted(shards),
            "differ": sorted(n for n in want if not torch.equal(back.get(n, torch.empty(0)), want[n])),
            "log_prob_error": float(((scored - sampled.log_probs) * sampled.response_mask).abs().max()),
            "sampled_tokens": int(sampled.response_mask.sum()),
            "sampled": sampled.response_ids.tolist(),
            "split_batches_equal": torch.equal(
                torch.cat([h.response_ids for h in halves]), sampled.response_ids
            ),
            "policy_version": sampled.policy_version.tolist(),
            "asleep_after_sleep": (instance.sleep(), instance.asleep)[1],  # no sleep mode on the CPU
        }
        instance.close()
    return out
