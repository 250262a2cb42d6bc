"""`NereusCallback`: the monitor -> controller -> strategy loop at every RL-step boundary.

After each step every rank builds the same :class:`~nereus_lightning.control.StepSignals` (the
step metrics are global); rank 0 asks the controller for a decision, broadcasts it
(``broadcast_object_list``), and every rank hands an admitted plan to the strategy, which
executes the transition before the next step. The controller's state (references, H_x,
calibration) and the run's history live in this callback's ``state_dict``, so they survive a
checkpoint and a resume under another world size.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from typing_extensions import override

from nereus_lightning.control import Controller, ControllerConfig, PlannerBackend
from nereus_lightning.control.follower import PlanController
from nereus_lightning.control.resources import NodeInventory, ResourceProvider
from nereus_lightning.control.signals import PEAK_STAGES, StepSignals
from nereus_lightning.lightning.console import announce, executed_transitions
from nereus_lightning.lightning.roles import RoleModule
from nereus_lightning.lightning.strategy import NereusStrategy
from nereus_lightning.plan.layout import Plan
from nereus_lightning.spec.cluster import ClusterSpec, cluster_preset
from nereus_lightning.spec.errors import InfeasiblePlanError, NereusConfigError
from nereus_lightning.spec.workload import Workload

# What a decision record keeps of the strategy's transition record (JSON-serialisable).
TRANSITION_KEYS = ("mode", "counts", "bytes", "predicted_s", "reason")
PEAK_MEMORY = "perf/max_memory_allocated_gb"  # the step metric a rank's peak GPU memory comes in

#: Builds the controller on rank 0 at the start of training: ``f(module, world_size)``.
ControllerFactory = Callable[[RoleModule, int], PlanController]


def default_controller(
    module: RoleModule,
    world_size: int,
    decision_log: str | None = None,
    cluster: ClusterSpec | str = "cpu4",
    **config: Any,
) -> Controller:
    """The planner-backed controller of ``module``'s models and workload on ``cluster`` (a ``ClusterSpec``
    or preset name) sized to ``world_size`` ranks."""
    specs = module.role_models().specs()
    backend = PlannerBackend.for_models(  # the pool is the Trainer's: Trainer(devices=...), trainer.devices
        specs["actor"], critic=specs.get("critic"), reference=specs["reference"], pool_key="trainer.devices"
    )
    spec = (cluster_preset(cluster) if isinstance(cluster, str) else cluster).with_gpus(world_size)
    return Controller(backend, spec, module.workload(0), ControllerConfig(**config), log=decision_log)


class NereusCallback(pl.Callback):
    """Feeds the controller every step and applies its decisions through :class:`NereusStrategy`.

    The step's metrics come from the module's ``training_step`` output (a mapping of floats, as
    ``RLModule`` returns): response and prompt lengths, ``timing_s/*`` and every rank's
    ``perf/max_memory_allocated_gb`` (and its per-stage ``perf/max_memory_allocated_gb/<stage>``)
    become the controller's :class:`StepSignals`.

    Args:
        controller: a :class:`~nereus_lightning.control.PlanController`, e.g.
            :class:`nereus_lightning.control.Controller` or
            :class:`~nereus_lightning.control.PoolFollower`; or ``f(module, world_size) ->
            controller``, built lazily on rank 0; ``None`` builds the planner-backed controller
            of the module's models and workload on the strategy's cluster.
        resources: the GPU pool per step (``pool(step) -> tuple[int, ...]``); ``None``: all ranks.
            A :class:`~nereus_lightning.control.NodeInventory` is bound to the job's ranks at the
            start and asked on every rank at every step.
        decision_log: a JSON-lines file for the decision log (rank 0 appends).
        plot_path: where to write the reward / latency plot at the end (``None``: no plot).
    """

    def __init__(
        self,
        controller: PlanController | ControllerFactory | None = None,
        resources: ResourceProvider | None = None,
        decision_log: str | None = None,
        plot_path: str | None = None,
    ) -> None:
        self.controller_factory = controller
        self.controller: PlanController | None = None
        self.resources = resources
        self.decision_log = decision_log
        self.plot_path = plot_path
        self.history: list[dict[str, float]] = []
        self.decisions: list[dict[str, Any]] = []
        self._restored: dict[str, Any] | None = None
        self._last_transition_s = 0.0  # the transition before the next step: seconds and bytes moved
        self._last_transition_bytes = 0.0
        self._compile_workers: threading.Thread | None = None  # their shutdown, from on_train_end

    @property
    def transition_count(self) -> int:
        """Transitions executed so far (counted on rank 0; they survive a resume with the decisions)."""
        return executed_transitions(self.decisions)

    # ---- setup ---------------------------------------------------------------------------
    def _build_controller(self, trainer: pl.Trainer, module: RoleModule) -> PlanController:
        factory = self.controller_factory
        if isinstance(factory, PlanController):
            return factory
        if factory is not None:
            return factory(module, trainer.world_size)
        cluster = _strategy(trainer).topology  # the launch's nodes x GPUs per node
        return default_controller(module, trainer.world_size, self.decision_log, cluster=cluster)

    def pool(self, step: int, world_size: int) -> tuple[int, ...]:
        """The GPU pool at ``step`` (all ranks without a resource provider), clipped to the job's ranks."""
        if self.resources is None:
            return tuple(range(world_size))
        return tuple(g for g in self.resources.pool(step) if g < world_size)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = _strategy(trainer)
        if not isinstance(pl_module, RoleModule):
            raise NereusConfigError(
                f"NereusCallback: {type(pl_module).__name__} has no role_models() and workload(step) "
                "(nereus_lightning.lightning.roles.RoleModule); the controller plans for them"
            )
        if isinstance(self.resources, NodeInventory):  # per node, gathered through the job's ranks
            from nereus_lightning.lightning.launch import DistExchange

            exchange = DistExchange(strategy.root_device)
            self.resources.attach(exchange, trainer.node_rank, trainer.local_rank, trainer.num_devices)
        if trainer.is_global_zero:
            self.controller = self._build_controller(trainer, pl_module)
            if trainer.max_steps > 0 and isinstance(self.controller, Controller):
                self.controller.max_steps = trainer.max_steps  # what bounds the horizon H_x
            if self._restored is not None:
                self.controller.load_state_dict(self._restored)
        step = trainer.global_step
        given = strategy.plan
        if given is not None and self._restored is None:
            # The user's plan is the starting point: the controller adapts from it.
            if self.controller is not None:
                self.controller.plan = given
            strategy.transition(given)
            return
        # Initial plan before the first step (or on resume: the controller's plan for this pool).
        signals = _signals(step, {}, self.pool(step, trainer.world_size), expected=pl_module.workload(step))
        self._decide_and_apply(trainer, signals, initial=True)

    # ---- every step ----------------------------------------------------------------------
    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = _strategy(trainer)
        if strategy.step_abandoned:  # dropped on a stop signal (every rank): nothing to decide on
            return
        stats = {k: float(v) for k, v in outputs.items()} if isinstance(outputs, Mapping) else {}
        step = trainer.global_step  # already counts the step just finished
        plan = strategy.plan
        if plan is not None:
            for name, cand in plan.items():
                dims = (
                    ("dp", cand.dp),
                    ("tp", cand.layout.tp),
                    ("pp", cand.layout.pp),
                    ("micro_batch", cand.micro_batch),
                )
                for key, val in dims:
                    stats[f"plan/{name}/{key}"] = float(val)
        stats["plan/num_gpus"] = (
            float(len(_used_gpus(plan))) if plan is not None else float(trainer.world_size)
        )
        pool = self.pool(step, trainer.world_size)
        # A rank that leaves the pool stays alive (the process group keeps every rank), so the
        # transition may still read its units: it is draining, as under a revocation notice.
        draining = tuple(g for g in self.pool(step - 1, trainer.world_size) if g not in pool)
        assert isinstance(pl_module, RoleModule)  # checked at the start of training
        signals = _signals(step, stats, pool, draining, expected=pl_module.workload(step - 1))
        if self._last_transition_s:
            # The measured duration of the transition executed before this step: the controller's
            # transition-cost calibration reads it.
            signals = replace(signals, transition_time=self._last_transition_s)
        stats["pool/num_gpus"] = float(len(self.pool(step - 1, trainer.world_size)))  # during this step
        # A step's row carries the transition that ran before it: step k is the k-th step (from 0)
        # in the console, the decision log, the metrics and the summary alike.
        stats["timing_s/transition"] = self._last_transition_s
        stats["transition/bytes"] = self._last_transition_bytes
        if trainer.is_global_zero:
            record = {"step": float(step - 1), **{k: float(v) for k, v in stats.items()}}
            self.history.append(record)
        for key in ("timing_s/transition", "transition/bytes"):
            pl_module.log(key, stats[key], rank_zero_only=True)
        pl_module.log_dict(
            {k: v for k, v in stats.items() if k.startswith(("plan/", "pool/"))}, rank_zero_only=True
        )
        if 0 <= trainer.max_steps <= step:  # no step follows: nothing to move for
            return
        seconds = self._decide_and_apply(trainer, signals)
        done = strategy.transitions
        self._last_transition_s = seconds
        self._last_transition_bytes = float(done[-1].get("bytes", 0.0)) if seconds and done else 0.0

    def _decide_and_apply(self, trainer: pl.Trainer, signals: StepSignals, initial: bool = False) -> float:
        """Rank 0 decides, everyone receives the decision, an admitted plan is executed; returns seconds."""
        payload: Any = None
        if self.controller is not None:  # rank 0
            try:
                decision = self.controller.step(signals)
                target = decision.target if decision.changes_plan else None
                if initial and target is None:
                    # Resumed controller that keeps its plan: the fresh strategy still needs it.
                    target = self.controller.plan
                payload = ("ok", decision.kind, target, decision.to_json())
            except InfeasiblePlanError as exc:
                payload = ("infeasible", str(exc), None, None)
        if dist.is_available() and dist.is_initialized():
            box = [payload]
            dist.broadcast_object_list(box, 0)
            payload = box[0]
        status, kind, target, record = payload
        if status == "infeasible":
            raise InfeasiblePlanError(f"the controller found no feasible plan at step {signals.step}: {kind}")
        if record is not None and kind != "none":
            self.decisions.append(record)
        strategy = _strategy(trainer)
        if target is None:
            if trainer.is_global_zero and record is not None:
                announce(record)
            return 0.0
        seconds = strategy.transition(target)
        if trainer.is_global_zero and record is not None:
            done = strategy.transitions
            executed = done[-1] if done and not initial else None
            if not initial:
                record["measured_s"] = seconds
            if executed is not None:
                record["transition"] = {k: v for k, v in executed.items() if k in TRANSITION_KEYS}
            announce(record, executed)
        return 0.0 if initial else seconds

    # ---- the end -------------------------------------------------------------------------
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from nereus_lightning.engines.static import stop_compile_workers

        self._compile_workers = stop_compile_workers()  # while the final checkpoint is written
        if trainer.is_global_zero and self.plot_path and self.history:
            from nereus_lightning.lightning.plot import plot_run

            os.makedirs(os.path.dirname(os.path.abspath(self.plot_path)), exist_ok=True)
            plot_run(self.history, self.plot_path)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._compile_workers is not None:
            self._compile_workers.join()
            self._compile_workers = None

    # ---- state ---------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        controller = self.controller.state_dict() if self.controller is not None else None
        return {
            "controller": controller,
            "history": list(self.history),
            "decisions": list(self.decisions),
            "last_transition": [self._last_transition_s, self._last_transition_bytes],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("controller")
        self.history = list(state_dict.get("history", []))
        self.decisions = list(state_dict.get("decisions", []))
        self._last_transition_s, self._last_transition_bytes = state_dict.get("last_transition", (0.0, 0.0))


def _used_gpus(plan: Plan | None) -> set[int]:
    return {g for _, c in plan.items() for g in c.gpus} if plan is not None else set()


def _strategy(trainer: pl.Trainer) -> NereusStrategy:
    """The Trainer's strategy, which executes the controller's plans."""
    strategy = trainer.strategy
    if not isinstance(strategy, NereusStrategy):
        raise NereusConfigError(
            f"trainer.strategy: NereusCallback applies plans through NereusStrategy, not a "
            f'{type(strategy).__name__}; use Trainer(strategy=NereusStrategy()) or strategy="nereus"'
        )
    return strategy


def _peak_memory(stats: Mapping[str, float]) -> tuple[dict[int, float], dict[str, dict[int, float]]]:
    """Every rank's peak GPU memory in bytes, over the step and per workflow stage (``generation``,
    ``inference``, ``training``: what the body reported as ``perf/max_memory_allocated_gb/<name>``).

    Collective; both empty without GPUs.
    """
    if PEAK_MEMORY not in stats:  # no GPU: absent on every rank alike
        return {}, {}
    mine = (
        stats[PEAK_MEMORY] * 2**30,
        {
            stage: stats[f"{PEAK_MEMORY}/{name}"] * 2**30
            for name, stage in PEAK_STAGES.items()
            if f"{PEAK_MEMORY}/{name}" in stats
        },
    )
    every: list[Any] = [mine]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()  # per rank (every entry filled by the gather)
        dist.all_gather_object(every, mine)
    stages: dict[str, dict[int, float]] = {}
    for rank, (_, per_stage) in enumerate(every):
        for stage, peak in per_stage.items():
            stages.setdefault(stage, {})[rank] = float(peak)
    return {rank: float(total) for rank, (total, _) in enumerate(every)}, stages


def _signals(
    step: int,
    stats: Mapping[str, float],
    pool: Sequence[int],
    draining: Sequence[int] = (),
    *,
    expected: Workload,
) -> StepSignals:
    """The controller's view after ``step``: the step's metrics, and where the module reported no
    lengths, the ones its ``workload`` expects (so a module that reports nothing changes nothing)."""
    mean = max(stats.get("response_length/mean", expected.response_len), 1.0)
    p95 = max(stats.get("response_length/p95", mean), mean)
    stage_time = {k.split("/", 1)[1]: v for k, v in stats.items() if k.startswith("timing_s/")}
    peak_memory, stage_peak_memory = _peak_memory(stats)
    return StepSignals(
        step=step,
        response_len=mean,
        response_len_p95=p95,
        prompt_len=stats.get("prompt_length/mean", float(expected.prompt_len)),
        gpus=tuple(pool),
        draining=tuple(draining),
        stage_time=stage_time,
        peak_memory=peak_memory,
        stage_peak_memory=stage_peak_memory,
    )
