"""Golden DAG digests: the transition planner's output on fixed cases, as sha256 digests.

Every case is a plan pair (``current, target, models, cluster, workload``): every scenario of
``benchmarks/bench_transition.py`` (the overlap table's random cases, the timed scenarios at 32 to
1,024 GPUs, the DP doublings of the L_tran comparison), a few hundred seeded random cases from
``transition.scenarios`` (``random_case`` per overlap kind and ``random_colocated_case``, 8 to 1,024
GPUs), and hand-picked single model-stage layout changes. Per case three digests:

* ``input``: the plans and the cluster (when it changes, the case itself changed, e.g. the planner
  now makes other plans for a timed scenario: regenerate, the DAG digests then say nothing);
* ``dag``: ``build_transition``'s DAG (batched where the planner batches), or its
  ``InfeasiblePlanError`` message;
* ``baseline``: ``per_component_baseline``'s outcome (``ok``, ``conflict`` as the validator finds
  it, or ``wait cycle``) and DAG (every local DAG one node per replica).

A DAG's digest is the sha256 of a canonical serialisation of its nodes in order: id, primitive,
model-stage, deps, resource deps and, per lane (one for an ordinary node), its source and target
units (TP, PP, GPUs), its transfers (source GPU, destination GPU, bytes, piece) and its memory
effects (GPU, net, transient), each in the node's own order.

Regenerate (only for a change of the planner that is meant and explained)::

    PYTHONPATH=src python -m tests.transition.golden
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from nereus_lightning.plan.layout import Plan
from nereus_lightning.spec.errors import InfeasiblePlanError
from nereus_lightning.transition import TransitionDAG, build_transition, per_component_baseline, validate
from nereus_lightning.transition.scenarios import OVERLAP_KINDS, random_case, random_colocated_case
from tests.helpers import cand, plan
from tests.transition.helpers import MODELS, PPO, with_memory

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("golden_dags.json")
DIGEST_CHARS = 16  # hex characters kept of each sha256 (64 bits: no collision among these cases)
SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)

Args = tuple  # (current, target, models, cluster, workload)


def _bench():
    """``benchmarks/bench_transition.py`` as a module (the benchmarks are scripts, not a package)."""
    name = "bench_transition"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "bench_transition.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def cases() -> Iterator[tuple[str, Callable[[], Args]]]:
    """``(case id, a function making its arguments)`` for every golden case, in a fixed order."""
    yield from _benchmark_cases()
    for seed in range(8):  # odd seeds with more memory: more of them feasible
        for kind in OVERLAP_KINDS:
            for n in SIZES:
                yield f"random {kind} n={n} seed={seed}", _random(kind, n, seed)
    for seed in range(12):
        for n in SIZES:
            yield f"random colocated n={n} seed={seed}", _colocated(n, seed)
    for i, (a, b) in enumerate(_hand_pairs()):
        yield f"hand {i}: {a.layout}x{len(a.gpus)} -> {b.layout}x{len(b.gpus)}", _single(a, b)


def _benchmark_cases() -> Iterator[tuple[str, Callable[[], Args]]]:
    bench = _bench()
    # The overlap table (``overlap_table``'s defaults: 40 cases per kind, one rng, seed 0).
    rng, sizes = random.Random(0), (8, 16, 32, 64, 128, 256)
    for kind in OVERLAP_KINDS:
        for i in range(40):
            args = random_case(rng, kind, sizes[i % len(sizes)]).args()
            yield f"bench overlap {kind} {i}", lambda args=args: args
    for n in (32, 64, 128, 256, 512, 1024):
        for name, args in bench._scenarios(n).items():
            yield f"bench timed {name} n={n}", lambda args=args: args
    models, cluster, work = bench.default_models(), bench.CLUSTER_PRESETS["paper_cluster3"], PPO
    for n in bench.PAPER_EXTEND_S:
        a, b = bench.doubling_plan(n), bench.doubling_plan(2 * n)
        yield f"bench extend {n}", lambda a=a, b=b: (a, b, models, cluster, work)
        a, b = bench._as_inference(a), bench._as_inference(b)
        yield f"bench extend weights only {n}", lambda a=a, b=b: (a, b, models, cluster, work)


def _slack(seed: int) -> tuple[float, float]:
    return (1.0, 1.6) if seed % 2 == 0 else (1.5, 2.5)


def _random(kind: str, n: int, seed: int) -> Callable[[], Args]:
    return lambda: random_case(random.Random(f"{kind} {n} {seed}"), kind, n, slack=_slack(seed)).args()


def _colocated(n: int, seed: int) -> Callable[[], Args]:
    return lambda: random_colocated_case(random.Random(f"colocated {n} {seed}"), n, slack=_slack(seed)).args()


def _hand_pairs() -> list:
    """Single model-stage layout changes on 256 GPUs that every path of the local planner meets."""
    return [
        (cand(2, 1, range(64)), cand(1, 1, range(64))),  # full split in place
        (cand(4, 1, range(64)), cand(2, 1, range(64))),  # split into strided TP2 slots
        (cand(2, 2, range(64)), cand(1, 2, range(64))),  # TP split with PP
        (cand(4, 2, range(64)), cand(4, 1, range(64))),  # PP split
        (cand(2, 1, range(64)), cand(4, 1, range(64))),  # pairwise merge of consecutive units
        (cand(1, 2, range(64)), cand(1, 4, range(64))),  # PP merge
        (cand(2, 1, range(64)), cand(8, 1, range(64))),  # merge of four
        (cand(1, 1, range(64)), cand(2, 1, range(64))),  # merge of strided slots
        (cand(2, 1, range(64)), cand(4, 1, range(128))),  # merge and extend
        (cand(2, 1, range(64)), cand(1, 1, range(32, 160))),  # split, move, extend
        (cand(2, 1, (*range(0, 64, 2), *range(1, 64, 2))), cand(4, 1, range(64))),  # irregular
        (cand(4, 1, range(64)), cand(2, 1, (*range(0, 64, 2), *range(1, 64, 2)))),  # irregular
        (cand(2, 2, range(64)), cand(4, 1, range(128))),  # reshard through T_sub
        (cand(2, 1, range(64)), cand(2, 1, range(128))),  # DP grows after the current GPUs
        (cand(1, 1, range(0, 64, 2)), cand(1, 1, (*range(0, 64, 2), *range(64, 128)))),  # chains
        (cand(2, 1, range(16)), cand(2, 1, range(8))),  # shrink
        (cand(2, 2, range(8)), cand(2, 2, range(16, 32))),  # move away
        (cand(1, 1, (0, 1, 2, 3)), cand(1, 1, (2, 3, 4, 5, 8, 9))),  # partly onto old GPUs
        (cand(2, 1, (0, 1, 2, 3)), cand(2, 1, (1, 2, 8, 9))),  # units across old ones
        (cand(4, 1, range(0, 64, 2)), cand(4, 1, range(64))),  # strided units, grown
        (cand(4, 8, range(32)), cand(8, 2, range(32))),  # the paper's example
    ]


def _single(a, b) -> Callable[[], Args]:
    cluster = with_memory(400).with_gpus(256)  # memory is not what these cases test
    return lambda: (plan(actor_train=a), plan(actor_train=b), MODELS, cluster, PPO)


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def _plan_record(p: Plan) -> list:
    """Each candidate's TP, PP and GPUs (and, when sharded, its shard degree and ZeRO stage)."""
    return [
        [name, c.layout.tp, c.layout.pp, list(c.gpus)]
        + ([c.layout.shard, c.layout.zero] if c.layout.shard > 1 else [])
        for name, c in p.items()
    ]


def input_digest(args: Args) -> str:
    """The digest of a case's plans and cluster."""
    current, target, models, cluster, _ = args
    record = [_plan_record(current), _plan_record(target), repr(cluster), sorted(models)]
    return _short(json.dumps(record, separators=(",", ":")))


def _units(units) -> list:
    return [[u.layout.tp, u.layout.pp, list(u.gpus)] for u in units]


def node_records(dag: TransitionDAG) -> Iterator[list]:
    """The canonical record of every node (see the module docstring)."""
    for n in dag.nodes:
        lanes = [
            [
                _units(lane.sources),
                _units(lane.targets),
                [[t.src_gpu, t.dst_gpu, int(t.bytes), list(t.what)] for t in lane.transfers],
                [[g, float(net), float(transient)] for g, net, transient in lane.mem],
            ]
            for lane in n.lanes()
        ]
        yield [n.id, n.op.value, n.model_stage, list(n.deps), list(n.resource_deps), lanes]


def dag_digest(dag: TransitionDAG) -> str:
    """The sha256 (first ``DIGEST_CHARS`` hex characters) of ``dag``'s canonical serialisation."""
    h = hashlib.sha256()
    for record in node_records(dag):
        h.update(json.dumps(record, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()[:DIGEST_CHARS]


def case_digests(args: Args) -> dict[str, str]:
    """The three digests of one case (see the module docstring); asserts that a DAG built validates."""
    try:
        dag = build_transition(*args)
    except InfeasiblePlanError as err:
        digest = "infeasible " + _short(str(err))
    else:
        report = validate(dag)
        assert report.valid, report.problems
        digest = dag_digest(dag)
    baseline = per_component_baseline(*args)
    return {
        "input": input_digest(args),
        "dag": digest,
        "baseline": f"{baseline.outcome}: {dag_digest(baseline.dag)}",
    }


def compute() -> dict[str, dict[str, str]]:
    """Every case's digests, by case id."""
    out: dict[str, dict[str, str]] = {}
    for case_id, make in cases():
        assert case_id not in out, f"two golden cases are called {case_id!r}"
        out[case_id] = case_digests(make())
    return out


def main() -> None:
    """Write ``golden_dags.json`` from the planner as it is now."""
    digests = compute()
    lines = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in digests.items()]  # one case a line
    GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    feasible = sum(not d["dag"].startswith("infeasible") for d in digests.values())
    print(f"wrote {GOLDEN} ({len(digests)} cases, {feasible} feasible)")


if __name__ == "__main__":
    main()
