"""The per-process registry of live units: every model-stage's units, and this rank's EMUs.

Every rank keeps the same picture of which units are alive (rank tuples and layouts) and holds
the :class:`~nereus_lightning.emu.unit.EMU` objects of the units it belongs to. The primitives
update it on every rank that calls them; a rank that skips a primitive it is not part of keeps
an older picture, and the overlap / last-copy checks on that rank see only that picture.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from nereus_lightning.emu.schema import StateSchema
from nereus_lightning.emu.unit import EMU
from nereus_lightning.plan.units import Unit
from nereus_lightning.spec.errors import NereusConfigError, require


class Registry:
    """Live units per model-stage (all ranks) and the local EMUs (member ranks)."""

    def __init__(self) -> None:
        self.units: dict[str, dict[Unit, EMU | None]] = {}
        self.schemas: dict[str, StateSchema] = {}
        self.trains: dict[str, bool] = {}

    def declare(self, model_stage: str, schema: StateSchema, trains: bool) -> None:
        """Record a model-stage's schema (so a rank can receive its state without holding any)."""
        known = self.schemas.get(model_stage)
        require(
            known is None or known == schema,
            "model_stage",
            f"{model_stage!r} was declared with another schema",
        )
        self.schemas[model_stage] = schema
        self.trains[model_stage] = trains
        self.units.setdefault(model_stage, {})

    def schema(self, model_stage: str) -> StateSchema:
        """The schema of ``model_stage``; an error naming the fix if it was never declared here."""
        if model_stage not in self.schemas:
            raise NereusConfigError(
                f"model_stage: {model_stage!r} is unknown on this rank; build its first unit with "
                "emu.create_unit (or call registry().declare) on every rank"
            )
        return self.schemas[model_stage]

    def add(self, model_stage: str, unit: Unit, emu: EMU | None) -> None:
        """Record a live unit (with this rank's EMU when it is a member)."""
        self.schema(model_stage)
        self.units[model_stage][unit] = emu

    def remove(self, model_stage: str, unit: Unit) -> EMU | None:
        """Forget a unit; returns this rank's EMU of it, if any."""
        return self.units.get(model_stage, {}).pop(unit, None)

    def live(self, model_stage: str) -> tuple[Unit, ...]:
        """The live units of ``model_stage`` (its DP group), in creation order."""
        return tuple(self.units.get(model_stage, {}))

    def local(self, model_stage: str, unit: Unit) -> EMU:
        """This rank's EMU of ``unit``."""
        units = self.units.get(model_stage, {})
        require(
            unit in units,
            "unit",
            f"{unit} is not a live unit of {model_stage!r}; live: {[str(u) for u in units]}",
        )
        emu = units[unit]
        if emu is None:
            raise NereusConfigError(f"unit: this rank holds no part of {model_stage!r} unit {unit}")
        return emu

    def mine(self, model_stage: str) -> EMU | None:
        """This rank's EMU of ``model_stage`` (None: this rank holds no part of it)."""
        return next((e for e in self.units.get(model_stage, {}).values() if e is not None), None)

    def require_live(self, model_stage: str, units: Iterable[Unit]) -> None:
        """Reject units that are not live units of ``model_stage``."""
        live = self.units.get(model_stage, {})
        for unit in units:
            require(
                unit in live,
                "unit",
                f"{unit} is not a live unit of {model_stage!r}; live: {[str(u) for u in live]}",
            )

    def require_free(
        self,
        model_stage: str,
        ranks: Iterable[int],
        ignore: Collection[Unit] = (),
        colocate_with: Collection[str] = (),
    ) -> None:
        """Reject ``ranks`` overlapping a live unit (other than ``ignore``) of any model-stage not in
        ``colocate_with``.
        """
        wanted = set(ranks)
        for stage, units in self.units.items():
            if stage != model_stage and stage in colocate_with:
                continue
            for unit in units:
                if unit in ignore:
                    continue
                shared = sorted(wanted & set(unit.gpus))
                require(
                    not shared,
                    "target ranks",
                    f"ranks {shared} already hold live unit {unit} of {stage!r}; destroy it first, "
                    "pick free ranks, or pass colocate_with for model-stages that never run at the same time",
                )

    def clear(self) -> None:
        """Forget everything (tests; a fresh job)."""
        self.units.clear()
        self.schemas.clear()
        self.trains.clear()


_REGISTRY = Registry()


def registry() -> Registry:
    """This process's registry."""
    return _REGISTRY
