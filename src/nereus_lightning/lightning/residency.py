"""`Residency`: where this rank's units wait between uses.

Memory between uses follows the planner's rule (``plan.memory.boundary_state_bytes``): training
state stays on its GPUs; a generation or inference unit lives in host memory and is on its GPU
only while its model-stage runs (:meth:`Residency.in_use`), so model-stages sharing a GPU take it
in turn. Its EMU tensors are its module's parameters (the same objects), so
:meth:`~nereus_lightning.emu.EMU.offload` / ``onload`` move both. A generation model-stage's
rollout engine sleeps (frees its device memory) before its unit goes to the host; one that
decodes on weights of its own leaves the unit on the host while it generates.

A unit that *follows* its training stage (:meth:`Residency.follow`: the weight sync is local to
every rank) is refilled from the training stage's shards on its device at each use and goes to
the host without its values: a weight sync then moves nothing over the host link.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

from nereus_lightning import emu
from nereus_lightning.lightning.rollout_engines import RolloutEngines
from nereus_lightning.spec.workload import ModelStage


class Residency:
    """Moves this rank's non-training units between their devices and the host.

    Args:
        stages: every model-stage of the workflow by name (which of them train).
        engines: the generation model-stages' rollout engines.
    """

    def __init__(self, stages: Mapping[str, ModelStage], engines: RolloutEngines) -> None:
        self.stages = stages
        self.engines = engines
        self.following: dict[str, str] = {}  # model-stage -> the training stage it is refilled from

    def can_follow(self, model_stage: str) -> bool:
        """Whether ``model_stage`` may follow its training stage: not a generation stage whose engine
        decodes on weights of its own, taken from the unit's host copies (the same on every rank)."""
        generates = self.stages[model_stage].stage == "generation" and self.engines.decoding is not None
        return not generates or self.engines.kind.on_unit

    def follow(self, model_stage: str, source: str, refill: Callable[[], None]) -> None:
        """``model_stage`` holds ``source``'s current parameters from now on: ``refill`` (the weight sync
        as a local copy, :func:`~nereus_lightning.emu.sync.local_refill`) writes them at each onload
        (now, if on its device) instead of a weight sync."""
        self.following[model_stage] = source
        unit = emu.registry().mine(model_stage)
        if unit is None:
            return
        unit.refill = refill
        if unit.resident:
            unit.refill()
        else:
            unit.stale = True  # its host copies hold the weights before this sync

    def settle(self) -> None:
        """Every following unit back to plain residency, its host copies filled (before a transition,
        which changes the units they follow)."""
        for name in self.following:
            unit = emu.registry().mine(name)
            if unit is not None:
                if unit.stale:
                    unit.fill_host()
                unit.refill = None
        self.following = {}

    @contextmanager
    def in_use(self, model_stage: str) -> Iterator[None]:
        """This rank's unit of ``model_stage`` on its device while the block runs, back on the host after.

        Training units never leave their device; a generation unit whose engine decodes on weights
        of its own stays on the host (the engine takes the unit's shards from there).
        """
        unit = emu.registry().mine(model_stage)
        if unit is None or self.stages[model_stage].trains:
            yield
            return
        engine = self.engines.get(model_stage)
        if engine is None or engine.on_unit:
            unit.onload()  # a following unit is refilled on its device
        try:
            yield
        finally:
            self.offload(model_stage)

    def of(self, names: Iterable[str]) -> dict[str, bool]:
        """Whether this rank's unit of each of ``names`` is on its compute device (those it holds)."""
        return {n: unit.resident for n in names if (unit := emu.registry().mine(n)) is not None}

    def offload(self, model_stage: str) -> None:
        """This rank's idle unit of a non-training model-stage to the host, its engine asleep first."""
        unit = emu.registry().mine(model_stage)
        if unit is None or self.stages[model_stage].trains:
            return
        engine = self.engines.get(model_stage)
        if engine is not None:
            engine.sleep()
        unit.offload(keep=model_stage not in self.following)

    def offload_idle(self, names: Iterable[str]) -> None:
        """Every non-training unit of ``names`` on this rank to the host (between their uses)."""
        for name in names:
            self.offload(name)

    def onload(self, names: Iterable[str]) -> None:
        """Every unit of ``names`` on this rank back on its device (before transfers on device tensors)."""
        for name in names:
            unit = emu.registry().mine(name)
            if unit is not None:
                unit.onload()


__all__ = ["Residency"]
