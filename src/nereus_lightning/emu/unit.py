"""The Elastic Model Unit: one replica of one model-stage, as held by one of its ranks.

An EMU on ``ranks`` with ``Layout(tp, pp)`` puts rank index ``pp_rank * tp + tp_rank`` (as in
``Candidate``) at that position. Each rank holds, as plain tensors keyed by global names:
the parameter shards of its pipeline stage (``params``), for a training unit the AdamW state in
the same layout (``optim_state[name] = {"exp_avg", "exp_avg_sq", "step"}``, ZeRO-0; for a bf16/fp16
parameter the moments are fp32 and an fp32 ``"master"`` copy joins them: ``schema.optim_keys``),
and the unit's logical ``counters``. RNG streams are derived from the counters and the DP rank, so a new
replica needs no RNG state sent to it. The models/ code builds its modules from these very
tensors (same storage), so an optimizer step on the module updates the EMU.

:meth:`EMU.offload` moves a rank's tensors to host memory (pinned, when they were on a GPU) and
:meth:`EMU.onload` brings them back, each tensor object kept (``tensor.data`` is swapped), so a
module whose parameters ARE these tensors follows; :attr:`EMU.resident` says where they are.
On the CPU host and device are one: only the flag changes. A unit whose owner refills it at every
onload (a copy of a training stage's weights) goes to the host without its values
(``offload(keep=False)``): it is :attr:`EMU.stale` there, and :meth:`EMU.onload` has its
:attr:`EMU.refill` write it on the device; any other read refills its host copies first.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import astuple, dataclass, fields
from typing import Any

import torch
from torch import Tensor

from nereus_lightning.emu.host import HostBlock
from nereus_lightning.emu.schema import StateSchema
from nereus_lightning.models.optim import MASTER_KEY, off_master
from nereus_lightning.models.sharding import tp_slices
from nereus_lightning.plan.layout import Candidate, Layout
from nereus_lightning.plan.units import Position, Unit
from nereus_lightning.spec.errors import require


@dataclass(frozen=True)
class Counters:
    """The logical counters of a replica; equal on every rank of every replica of a model-stage."""

    optimizer_step: int = 0
    update_count: int = 0
    policy_version: int = 0
    stage_version: int = 0
    sample_position: int = 0  # global sample index after the last completed update
    seed: int = 0

    def as_tensor(self, device: torch.device | str = "cpu") -> Tensor:
        """The counters as an int64 vector (they travel inside the packed buffer)."""
        return torch.tensor(astuple(self), dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(cls, values: Tensor) -> Counters:
        """Inverse of :meth:`as_tensor`."""
        return cls(*(int(v) for v in values.tolist()))

    @classmethod
    def size(cls) -> int:
        """Number of counters."""
        return len(fields(cls))


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


class EMU:
    """One rank's part of one replica of ``model_stage`` (see the module docstring)."""

    def __init__(
        self,
        model_stage: str,
        schema: StateSchema,
        unit: Unit,
        rank: int,
        params: dict[str, Tensor],
        optim_state: dict[str, dict[str, Tensor]] | None = None,
        counters: Counters | None = None,
        trains: bool | None = None,
    ) -> None:
        self.model_stage = model_stage
        self.schema = schema
        self.unit = unit
        self.rank = rank
        self.params = params
        self.optim_state = optim_state if optim_state is not None else {}
        self.counters = counters or Counters()
        self.trains = bool(self.optim_state) if trains is None else trains
        # A sharded replica's EMU at rest: the keys ("param" or an optimizer key) of which it holds its
        # shard rank's dim-0 row blocks instead of whole (pp, tp) pieces (what its ZeRO stage shards).
        self.row_keys: frozenset[str] = frozenset()
        self.resident = True  # the tensors are on their compute device (see offload / onload)
        self._home: torch.device | None = None  # the compute device while offloaded from a GPU
        self._host: HostBlock | None = None  # page-locked host copies, kept for the next offload
        # the tensors onload brought back, with their versions: the host holds their values until one changes
        self._host_matches: list[tuple[weakref.ref[Tensor], int]] | None = None
        self.stale = False  # offloaded without its values (see :meth:`fill_host`)
        self.refill: Callable[[], None] | None = None  # writes every tensor on the device (see onload)

    # -- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_model(
        cls,
        model_stage: str,
        schema: StateSchema,
        model_or_state: Any,
        unit: Unit,
        rank: int,
        *,
        trains: bool = False,
        full_optim: Mapping[str, Mapping[str, Tensor]] | None = None,
        counters: Counters | None = None,
        device: torch.device | str | None = None,
    ) -> EMU:
        """Cut ``rank``'s shards from a full model (or its state dict), and AdamW state if ``trains``.

        ``full_optim`` maps global names to full-size ``exp_avg`` / ``exp_avg_sq`` / ``step`` (and,
        for bf16/fp16 parameters, optionally ``master``; without it the master is the parameter
        upcast); without ``full_optim`` a training unit starts from zeros (a fresh AdamW). The AdamW
        tensors are stored in ``schema.key_dtype`` (fp32 moments and master below fp32). A given
        master must round to the parameter bit for bit, as the optimizer step leaves them (a
        :class:`~nereus_lightning.spec.errors.NereusConfigError` names the first that does not).
        """
        schema.validate(unit.layout)
        full = (
            dict(model_or_state)
            if isinstance(model_or_state, Mapping)
            else dict(model_or_state.named_parameters())
        )
        device = _device(device)
        pos = unit.position(rank)
        params: dict[str, Tensor] = {}
        optim: dict[str, dict[str, Tensor]] = {}
        for name in schema.stage_names(unit.layout, pos.pp_rank):
            require(name in full, "model", f"parameter {name} missing from the given model/state dict")
            index = tp_slices(schema.shape_of[name], schema.placements[name], unit.layout.tp, pos.tp_rank)
            params[name] = full[name].detach()[index].to(device=device, copy=True).contiguous()
            if trains:
                given = (full_optim or {}).get(name)
                state = {}
                for key in schema.shaped_optim_keys(name):
                    if given is not None and key in given:
                        src = given[key][index]
                    elif key == MASTER_KEY:
                        src = params[name]
                    else:
                        src = torch.zeros_like(params[name])
                    dtype = schema.key_dtype(name, key)
                    state[key] = src.detach().to(device=device, dtype=dtype, copy=True).contiguous()
                if MASTER_KEY in state and given is not None and MASTER_KEY in given:
                    # Checkpoints store the master only (emu.dcp_state.params_from_masters).
                    require(
                        not bool(off_master(params[name], state[MASTER_KEY])),
                        "full_optim",
                        f"{name}: its master rounded to {schema.dtype_name_of[name]} is not the parameter; "
                        "give the master the parameter was rounded from (or none: the parameter upcast)",
                    )
                step = given["step"] if given is not None else torch.zeros((), dtype=torch.float32)
                state["step"] = step.detach().to(device=device, copy=True).reshape(())
                optim[name] = state
        return cls(model_stage, schema, unit, rank, params, optim, counters, trains)

    @classmethod
    def empty(
        cls,
        model_stage: str,
        schema: StateSchema,
        unit: Unit,
        rank: int,
        *,
        trains: bool,
        device: torch.device | str | None = None,
    ) -> EMU:
        """Uninitialised shards of the right shapes on ``rank`` (to be filled by a transfer)."""
        schema.validate(unit.layout)
        device = _device(device)
        pos = unit.position(rank)
        params: dict[str, Tensor] = {}
        optim: dict[str, dict[str, Tensor]] = {}
        for name in schema.stage_names(unit.layout, pos.pp_rank):
            shape, dtype = schema.shard_shape(name, unit.layout), schema.dtype_of(name)
            params[name] = torch.empty(shape, dtype=dtype, device=device)
            if trains:
                optim[name] = {
                    key: torch.empty(shape, dtype=schema.key_dtype(name, key), device=device)
                    for key in schema.shaped_optim_keys(name)
                }
                optim[name]["step"] = torch.empty((), dtype=torch.float32, device=device)
        return cls(model_stage, schema, unit, rank, params, optim, None, trains)

    # -- views -------------------------------------------------------------------------------------------

    @property
    def layout(self) -> Layout:
        """The unit's layout."""
        return self.unit.layout

    @property
    def position(self) -> Position:
        """This rank's (pp_rank, tp_rank)."""
        return self.unit.position(self.rank)

    @property
    def device(self) -> torch.device:
        """The device of the shards."""
        return next(iter(self.params.values())).device if self.params else torch.device("cpu")

    @property
    def shard_rank(self) -> int:
        """This rank's shard rank in its unit (0 when unsharded)."""
        return self.unit.gpus.index(self.rank) // self.layout.model_size

    def tensors(self) -> Iterator[tuple[str, str, Tensor]]:
        """Every state tensor as ``(name, key, tensor)``, key ``"param"`` or an optimizer key, in schema
        order.
        """
        if self.stale:
            self.fill_host()
        yield from self._all()

    def fill_host(self) -> None:
        """Write a stale unit's host copies again: onload (refilled), offload (no collectives)."""
        self.onload()
        self.offload()

    def _all(self) -> Iterator[tuple[str, str, Tensor]]:
        for name in self.schema.names:
            if name not in self.params:
                continue
            yield name, "param", self.params[name]
            state = self.optim_state.get(name)
            if state is not None:
                for key in self.schema.optim_keys(name):
                    yield name, key, state[key]

    def tensor(self, name: str, key: str) -> Tensor:
        """One state tensor (``key`` = ``"param"`` or an optimizer key)."""
        return self.params[name] if key == "param" else self.optim_state[name][key]

    def nbytes(self) -> int:
        """Bytes of every state tensor on this rank."""
        return sum(t.numel() * t.element_size() for _, _, t in self._all())

    def generator(self, dp_rank: int, stream: int = 0) -> torch.Generator:
        """A generator derived from the seed, the sample position and ``dp_rank`` (same on every rank of the
        replica).
        """
        c = self.counters
        seed = hash((c.seed, c.sample_position, dp_rank, stream)) & 0x7FFF_FFFF_FFFF_FFFF
        return torch.Generator(device=self.device).manual_seed(seed)

    # -- residency ---------------------------------------------------------------------------------------

    def offload(self, keep: bool = True) -> None:
        """Move this rank's tensors to host memory in place (no collectives); a no-op when already there.

        GPU tensors are copied into one page-locked :class:`~nereus_lightning.emu.host.HostBlock`
        (made on the first offload, reused after) and then point at it, so their device memory is
        freed once nothing else holds it. Tensors unwritten since :meth:`onload` (the same objects at
        the same versions: every in-place write bumps a tensor's version) are not copied: the host
        block still holds their values (a generation or inference unit between weight syncs).
        ``keep=False`` copies nothing: the unit is :attr:`stale` (its :attr:`refill` writes it at onload).
        """
        if not self.resident:
            return
        on_gpu = [t for _, _, t in self._all() if t.device.type != "cpu"]
        if on_gpu:
            unchanged = not keep or self._unchanged(on_gpu)
            if self._host is None or not self._host.holds(on_gpu):
                self._release_host()
                self._host = HostBlock(on_gpu, pin=on_gpu[0].device.type == "cuda")
                unchanged = not keep
            if not unchanged:
                for tensor, host in zip(on_gpu, self._host.tensors, strict=True):
                    host.copy_(tensor, non_blocking=self._host.pinned)
            self._home = on_gpu[0].device
            if self._host.pinned:
                torch.cuda.synchronize(self._home)  # copied (both ways) before anyone touches the host copies
            for tensor, host in zip(on_gpu, self._host.tensors, strict=True):
                tensor.data = host
        self._host_matches = None
        self.stale = not keep
        self.resident = False

    def _unchanged(self, tensors: list[Tensor]) -> bool:
        """Whether ``tensors`` are the ones :meth:`onload` brought back, none written since."""
        seen = self._host_matches
        return (
            seen is not None
            and len(seen) == len(tensors)
            and all(
                ref() is t and version == t._version for (ref, version), t in zip(seen, tensors, strict=True)
            )
        )

    def onload(self) -> None:
        """Bring this rank's tensors back to their compute device in place (no collectives); a no-op when
        resident. A :attr:`stale` unit is not loaded from the host: its :attr:`refill` writes it there.
        """
        if self.resident:
            return
        stale, self.stale = self.stale, False
        if stale and self.refill is None:
            raise RuntimeError(f"{self.model_stage} went to the host without its values and has no refill")
        if self._home is not None:
            tensors = [t for _, _, t in self._all()]
            for tensor in tensors:
                if stale:
                    tensor.data = torch.empty_like(tensor.data, device=self._home)
                else:  # from pinned memory, ordered on the current stream before any kernel that reads it
                    tensor.data = tensor.data.to(self._home, non_blocking=True)
            self._host_matches = None if stale else [(weakref.ref(t), t._version) for t in tensors]
        self.resident = True
        if stale:
            assert self.refill is not None
            self.refill()

    def free(self) -> None:
        """Drop every tensor this rank holds for the unit (no collectives)."""
        self.params = {}
        self.optim_state = {}
        self._release_host()

    def _release_host(self) -> None:
        """Give back the page-locked host copies (an offloaded unit keeps using them until it is onloaded)."""
        if self._host is not None:
            self._host.release()
        self._host = None
        self._host_matches = None

    def __repr__(self) -> str:
        return (
            f"EMU({self.model_stage!r}, {self.unit}, rank={self.rank}, {len(self.params)} tensors, "
            f"{self.nbytes()} B)"
        )


def replica_units(cand: Candidate) -> list[Unit]:
    """The units of a model-stage's candidate: one per replica, in replica order."""
    return [Unit(cand.layout, tuple(cand.replica_gpus(r))) for r in range(cand.dp)]
