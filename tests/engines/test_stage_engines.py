"""The rollout engine of a generation model-stage: one registry, the built-in engine on the unit, the
holder's loads by policy version, where units wait, and vLLM's one engine per process (without vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nereus_lightning.emu.unit import Counters
from nereus_lightning.engines import vllm_engine
from nereus_lightning.engines.base import Decoding, GenerationSite, StageEngine, UnitShards, sample_seeds
from nereus_lightning.engines.hf import HFGenerateEngine
from nereus_lightning.engines.registry import ENGINES, engine_kind
from nereus_lightning.engines.unit import UnitEngines
from nereus_lightning.lightning import residency, rollout_engines
from nereus_lightning.lightning.residency import Residency
from nereus_lightning.lightning.rollout_engines import RolloutEngines
from nereus_lightning.models import ReplicaComm, ShardedCausalLM
from nereus_lightning.models.generation import ShardedGenerator
from nereus_lightning.spec import workload
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.workload import GenerationEngine, workflow
from nereus_lightning.testing.tiny import tiny_model

EOS, PAD = 255, 0


def test_the_body_registry_and_the_brain_name_the_same_engines():
    assert list(ENGINES) == list(workload.ENGINES)
    assert engine_kind("vllm") is ENGINES["vllm"]
    with pytest.raises(NereusConfigError, match="algorithm.rollout_engine: 'sglang' is not one of"):
        engine_kind("sglang")


def test_the_built_in_engine_decodes_on_the_unit_as_transformers_generate_does():
    unit = ShardedCausalLM.from_model(tiny_model("llama"), ReplicaComm.single())
    sites = [_site("actor_gen", unit=unit)]
    engine = UnitEngines().place(sites, [], {}, Decoding(EOS, PAD), GenerationEngine())["actor_gen"]
    assert isinstance(engine, StageEngine) and engine.on_unit and engine.policy_version is None
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13]])
    mask = (ids != 0).long()
    seeds = sample_seeds(0, 0, [0, 1])
    got = engine.generate(ids, mask, 6, sample_seeds=seeds)
    want = HFGenerateEngine(ShardedGenerator(unit), EOS, PAD).generate(ids, mask, 6, sample_seeds=seeds)
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.equal(got.response_mask, want.response_mask)


# ---- the holder and residency, on stand-in units and engines -----------------------------------
@dataclass
class FakeUnit:
    version: int = 0
    resident: bool = False
    moves: list[str] = field(default_factory=list)

    @property
    def counters(self) -> Counters:
        return Counters(policy_version=self.version)

    schema = SimpleNamespace(shape_of={"w": (4, 2)}, placements={"w": None})
    unit = SimpleNamespace(gpus=(3, 5))
    rank = 5
    params = {"w": torch.zeros(2, 2)}

    def onload(self) -> None:
        self.resident = True
        self.moves.append("onload")

    def offload(self, keep: bool = True) -> None:
        self.resident = False
        self.moves.append("offload")


class OwnWeights:
    """A stand-in engine with weights of its own; records what it is asked."""

    def __init__(self, on_unit: bool = False) -> None:
        self.on_unit = on_unit
        self.loaded: list[UnitShards] = []
        self.calls: list[str] = []

    @property
    def policy_version(self) -> int | None:
        return self.loaded[-1].policy_version if self.loaded else None

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("not generated here")

    def load(self, shards: UnitShards) -> None:
        self.loaded.append(shards)

    def sleep(self) -> None:
        self.calls.append("sleep")

    def wake(self) -> None:
        self.calls.append("wake")

    def close(self) -> None:
        self.calls.append("close")


class OneEngineKind:
    def __init__(self, engine: OwnWeights) -> None:
        self.engine = engine
        self.on_unit = engine.on_unit
        self.placed: list[list[str]] = []

    def require_installed(self, key: str) -> None: ...

    def check_model(self, config: Any, key: str) -> None: ...

    def check_sites(self, sites: Any) -> None: ...

    def place(self, sites: Any, previous: Any, held: Any, decoding: Decoding, settings: Any) -> dict:
        self.placed.append([s.model_stage for s in sites])
        return {s.model_stage: self.engine for s in sites}


def _site(name: str, replicas: tuple = ((0,),), unit: Any = None, config: Any = None) -> GenerationSite:
    tp, pp = len(replicas[0]), 1
    config = config if config is not None else SimpleNamespace(vocab_size=256)
    return GenerationSite(name, replicas, tp, pp, config, torch.float32, unit)


def _registry(monkeypatch: pytest.MonkeyPatch, units: dict[str, FakeUnit]) -> None:
    held = SimpleNamespace(mine=units.get)
    for module in (rollout_engines, residency):
        monkeypatch.setattr(module.emu, "registry", lambda: held)


def test_an_engine_with_weights_of_its_own_takes_the_units_shards_when_its_version_moves(monkeypatch):
    unit = FakeUnit(version=4)
    _registry(monkeypatch, {"actor_gen": unit})
    engine = OwnWeights()
    kind = OneEngineKind(engine)
    held = RolloutEngines(kind, GenerationEngine(), Decoding(EOS, PAD))
    held.place([_site("actor_gen")])
    assert held.engine("actor_gen") is engine and held.engine("actor_gen") is engine
    assert [s.policy_version for s in engine.loaded] == [4]  # once: the second use found it current
    assert engine.loaded[0].tp_rank == 1 and engine.loaded[0].params is unit.params
    unit.version = 5  # a weight sync
    held.engine("actor_gen")
    assert [s.policy_version for s in engine.loaded] == [4, 5]
    with pytest.raises(NereusConfigError, match="actor_greedy_gen: no rollout engine with a unit on rank"):
        held.engine("actor_greedy_gen")


def test_without_decoding_no_engine_is_placed(monkeypatch):
    kind = OneEngineKind(OwnWeights())
    held = RolloutEngines(kind, GenerationEngine(), None)
    held.place([_site("actor_gen")])
    assert kind.placed == [] and held.get("actor_gen") is None


@pytest.mark.parametrize("on_unit", [False, True])
def test_a_generation_unit_waits_on_the_host_unless_its_engine_decodes_on_it(monkeypatch, on_unit):
    gen, infer = FakeUnit(), FakeUnit()
    _registry(monkeypatch, {"actor_gen": gen, "actor_infer": infer})
    engine = OwnWeights(on_unit=on_unit)
    held = RolloutEngines(OneEngineKind(engine), GenerationEngine(), Decoding(EOS, PAD))
    held.place([_site("actor_gen")])
    where = Residency({m.name: m for m in workflow("ppo")}, held)
    with where.in_use("actor_gen"):
        assert gen.resident is on_unit
    with where.in_use("actor_infer"):
        assert infer.resident
    assert where.of(["actor_gen", "actor_infer", "actor_train"]) == {"actor_gen": False, "actor_infer": False}
    assert engine.calls == ["sleep"]  # after its model-stage ran
    assert gen.moves == (["onload", "offload"] if on_unit else ["offload"])


# ---- vLLM's kind, without vLLM -------------------------------------------------------------------
def test_vllm_takes_one_layout_for_every_generation_model_stage():
    kind = engine_kind("vllm")
    config = SimpleNamespace(vocab_size=256)
    kind.check_sites([_site("actor_gen", ((0, 1),), config=config), _site("actor_greedy_gen", ((0, 1),))])
    with pytest.raises(NereusConfigError, match="one vLLM layout per process, but the plan gives"):
        kind.check_sites([_site("actor_gen", ((0, 1),)), _site("actor_greedy_gen", ((2, 3),))])
    with pytest.raises(NereusConfigError, match="plan.actor_gen: replica on ranks \\(1, 0\\)"):
        kind.check_sites([_site("actor_gen", ((1, 0),))])
    with pytest.raises(NereusConfigError, match="vocab_size=250 is not a multiple of 64"):
        kind.check_sites([_site("actor_gen", ((0, 1),), config=SimpleNamespace(vocab_size=250))])


def test_vllm_keeps_its_engine_while_the_generation_layout_stays(monkeypatch):
    built: list[tuple] = []

    class Instance:
        policy_version = None

        def __init__(self, replicas: tuple) -> None:
            self.replicas = replicas
            self.closed = False

        def close(self) -> None:
            self.closed = True

    def build_engine(config: Any, replicas: Any, dtype: Any, settings: Any) -> Instance | None:
        built.append(tuple(replicas))
        return Instance(tuple(replicas)) if 0 in {r for ranks in replicas for r in ranks} else None  # rank 0

    monkeypatch.setattr(vllm_engine, "build_engine", build_engine)
    kind, decoding = engine_kind("vllm"), Decoding(EOS, PAD)
    first = [_site("actor_gen", ((0,), (1,))), _site("actor_greedy_gen", ((0,), (1,)))]
    engines = kind.place(first, [], {}, decoding, GenerationEngine("vllm"))
    assert engines["actor_gen"] is engines["actor_greedy_gen"] and built == [((0,), (1,))]
    again = kind.place(first, first, engines, decoding, GenerationEngine("vllm"))
    assert again == engines and len(built) == 1  # the same layout: the engine stays
    other = [_site("actor_gen", ((1,),)), _site("actor_greedy_gen", ((1,),))]
    moved = kind.place(other, first, again, decoding, GenerationEngine("vllm"))
    assert moved == {} and built[-1] == ((1,),)  # rank 0 is off the new replicas: it holds none
    assert engines["actor_gen"].instance.closed
