"""A user's own RL LightningModule trains with `NereusStrategy` through the strategy's public interface.

:class:`Reinforce` is written the way a Lightning user writes one: it builds its role model, says
which roles its algorithm has (``role_models``) and the shape of its step (``workload``), and its
``training_step`` calls only the strategy's interface: ``slot`` (this rank's rows), ``stage``
(this rank's compute module), ``in_use``, ``update`` (the optimizer step), ``sync_weights`` and
``reduce``. It knows nothing about units, plans or transitions; the callback changes the plan
between steps (DP, then TP/PP) and the run goes on.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import json

import lightning.pytorch as pl
import pytest
import torch

from nereus_lightning.control import Decision, StepSignals
from nereus_lightning.lightning import NereusCallback, NereusStrategy, RoleModels
from nereus_lightning.models import MicroBatch, forward_logits, train_step
from nereus_lightning.plan.layout import Plan
from nereus_lightning.spec import Workload
from nereus_lightning.testing.tiny import VOCAB, tiny_model
from tests.lightning.helpers import plan_of, quiet_trainer

pytestmark = pytest.mark.distributed

TARGET = 7  # the reward is highest for this token and falls with the distance from it
PROMPTS = 8

# Steps 0-1 every model-stage dp4 (sharing every rank), step 2 a DP change, steps 3-4 TP and PP.
SHARDED = {  # generation dp2 x TP2, inference PP2, training TP2 x PP2
    "actor_gen": ((2, 1), (0, 1, 2, 3)),
    "actor_infer": ((1, 2), (0, 1)),
    "actor_train": ((2, 2), (3, 2, 1, 0)),
}
SCHEDULE = [{}, {}, {"actor_gen": (0, 1), "actor_infer": (2, 3), "actor_train": (2, 3)}, SHARDED, SHARDED]


class Reinforce(pl.LightningModule):
    """REINFORCE on a fixed set of prompts: one sampled token per prompt, rewarded by its closeness to
    ``TARGET``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False  # the strategy's units hold the optimizer (strategy.update)
        self.actor = tiny_model("llama", seed=0)
        self.prompts = torch.randint(0, VOCAB, (PROMPTS, 6), generator=torch.Generator().manual_seed(0))

    def role_models(self) -> RoleModels:
        return RoleModels("grpo", {"actor": self.actor}, learning_rates={"actor": 1e-2})

    def workload(self, step: int = 0) -> Workload:
        return Workload("grpo", PROMPTS, prompt_len=6, response_len=1.0, reward_model=False)

    def configure_optimizers(self) -> None:
        return None  # Lightning counts the step on its placeholder optimizer

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.prompts), batch_size=PROMPTS)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> dict[str, float]:
        strategy = self.trainer.strategy
        assert isinstance(strategy, NereusStrategy)
        (prompts,) = batch
        tokens = self._sample(strategy, prompts)
        reward = 1.0 - (tokens - TARGET).abs().float() / VOCAB
        advantage = reward - reward.mean()
        sequences = torch.cat([prompts, tokens[:, None]], dim=1)
        slot = strategy.slot("actor_train", len(prompts))
        if slot.active and slot.stop > slot.start:
            rows = slice(slot.start, slot.stop)

            def loss(log_probs: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
                return -(advantage[rows] * log_probs[:, -1]).sum() / len(prompts)

            train_step(strategy.stage("actor_train"), [MicroBatch(sequences[rows])], loss)
        norms = [strategy.update(name, max_norm=1.0).norm for name in strategy.training_stages()]
        strategy.sync_weights()
        self.optimizers().step()
        return {"reward/mean": float(reward.mean()), "grad_norm": max(n or 0.0 for n in norms)}

    def _sample(self, strategy: NereusStrategy, prompts: torch.Tensor) -> torch.Tensor:
        """One token per prompt from the generation model-stage, seeded by step and prompt (every rank)."""
        tokens = torch.zeros(len(prompts), dtype=torch.long)
        slot = strategy.slot("actor_gen", len(prompts))
        if slot.active and slot.stop > slot.start:
            with strategy.in_use("actor_gen"):
                logits = forward_logits(strategy.stage("actor_gen"), prompts[slot.start : slot.stop])
            probs = logits[:, -1].float().softmax(-1)
            for i, p in zip(slot.indices, probs, strict=True):
                seed = torch.Generator().manual_seed(1000 * self.global_step + i)
                if slot.is_leader:
                    tokens[i] = torch.multinomial(p, 1, generator=seed)[0]
        return strategy.reduce(tokens, reduce_op="sum")  # each sample reported by one leader


class Scripted:
    """A controller that runs ``SCHEDULE[step]``."""

    def __init__(self) -> None:
        self.plan: Plan | None = None

    def step(self, signals: StepSignals) -> Decision:
        target = plan_of("grpo", SCHEDULE[min(signals.step, len(SCHEDULE) - 1)])
        if target == self.plan:
            return Decision(signals.step, "none")
        kind = "initial" if self.plan is None else "transition"
        decision = Decision(signals.step, kind, current=self.plan, target=target, signals=signals)
        self.plan = target
        return decision

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class StateRecord(pl.Callback):
    """Rank 0 writes a digest of the actor's logical parameters after each step and before the next one
    (the transition runs in between), and the strategy's transitions at the end."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _digest(self, trainer: pl.Trainer, when: str) -> None:
        """``trainer.global_step`` counts the finished steps: "after" step ``s`` is ``(s + 1, "after")``."""
        strategy = trainer.strategy
        assert isinstance(strategy, NereusStrategy)
        params = strategy.units.logical_params("actor_train")  # collective; rank 0 gets them
        if params is not None:
            digest = hashlib.sha256(b"".join(params[n].numpy().tobytes() for n in sorted(params)))
            self._write({"step": trainer.global_step, "when": when, "digest": digest.hexdigest()})

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self._digest(trainer, "before")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self._digest(trainer, "after")

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        strategy = trainer.strategy
        assert isinstance(strategy, NereusStrategy)
        if trainer.is_global_zero:
            self._write({"transitions": [t.get("mode", "initial") for t in strategy.transitions]})


def test_a_users_module_trains_across_dp_and_tp_pp_changes(tmp_path):
    record = str(tmp_path / "record.jsonl")
    # StateRecord before NereusCallback: its batch end runs before the transition
    callbacks = [StateRecord(record), NereusCallback(controller=Scripted())]
    logger = pl.loggers.CSVLogger(tmp_path, name="logs")
    trainer = quiet_trainer(4, NereusStrategy(export_hf=False), 5, callbacks, logger)
    trainer.fit(Reinforce())
    assert trainer.state.finished  # (the ranks ran in forked processes: their step counts are below)
    rows = [json.loads(line) for line in open(record)]
    assert rows[-1] == {"transitions": ["initial", "dag", "dag"]}
    before = {r["step"]: r["digest"] for r in rows[:-1] if r["when"] == "before"}
    after = {r["step"]: r["digest"] for r in rows[:-1] if r["when"] == "after"}
    assert sorted(before) == [0, 1, 2, 3, 4] and sorted(after) == [1, 2, 3, 4, 5]
    # Every step changed the actor; what lies between two steps (a transition after steps 1 and 2,
    # nothing after 0 and 3) kept it bit for bit.
    assert len({*before.values(), after[5]}) == 6
    assert all(after[s] == before[s] for s in range(1, 5))
    # The steps ran under the plans of the schedule (what the callback logs per step).
    metrics = next(iter(glob.glob(str(tmp_path / "logs" / "*" / "metrics.csv"))))
    plans = [r for r in csv.DictReader(open(metrics)) if r.get("plan/actor_train/dp")]
    layouts = [tuple(int(float(r[f"plan/actor_train/{k}"])) for k in ("dp", "tp", "pp")) for r in plans]
    assert layouts == [(4, 1, 1), (4, 1, 1), (2, 1, 1), (1, 2, 2), (1, 2, 2)]
