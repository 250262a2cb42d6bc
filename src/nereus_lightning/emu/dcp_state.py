"""A model-stage's state through torch.distributed.checkpoint (DCP): the restart fallback and the test oracle.

Each rank offers its shards as DTensors on a one-dimensional mesh over its stage's TP group
(``Shard(tp_dim)``), replicated tensors as plain tensors, so DCP records every shard with its
global offsets. Loading into a unit of any other layout lets DCP compute, independently of our
transfer plans, which bytes each new shard needs. Both calls are collective over the default
process group (ranks without a unit of the model-stage take part with nothing).

A training unit's bf16/fp16 parameter is stored as its fp32 master only (key ``master/<name>``, no
``param/<name>``): the parameter is always its master rounded, so loading rounds the master into
it as the optimizer step does (see :func:`params_from_masters`), on any layout. The directory's
:data:`PARAMS_FROM_MASTERS` file names those parameters and their dtype for readers without a unit
(export). Checkpoints that also hold ``param/<name>`` load the same way.

Loading runs no code from the checkpoint. DCP's own ``FileSystemReader.read_metadata`` unpickles
the ``.metadata`` file with the unrestricted ``pickle`` module (torch 2.4 to 2.13), and its planner
loads entries stored as bytes with ``torch.load`` outside weights-only mode (``load_bytes``), so
either can run any code a file carries. :class:`SafeReader` reads ``.metadata`` with an
unpickler that builds DCP's own metadata records only and sets nothing but their fields
(:mod:`~nereus_lightning.emu.dcp_metadata`), refuses bytes entries (a Nereus checkpoint holds
tensors only), checks every record and that every data file is there and long enough, and names
the file that fails to load. Tensor data is read by DCP with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.futures import Future as TorchFuture

from nereus_lightning.emu.dcp_metadata import (  # noqa: F401 (re-exported: where readers found them)
    DCP_METADATA,
    RestrictedUnpickler,
    dcp_global,
    read_dcp_metadata,
)
from nereus_lightning.emu.host import HostBlock
from nereus_lightning.emu.registry import registry
from nereus_lightning.emu.schema import StateSchema
from nereus_lightning.emu.unit import EMU, Counters
from nereus_lightning.models.groups import collective_timeout, member_group
from nereus_lightning.models.optim import MASTER_KEY, off_master
from nereus_lightning.models.zero import ZeroShards, cut_rows
from nereus_lightning.spec.errors import CheckpointError

#: In each model-stage's DCP state: the global step the checkpoint was saved at (a one-element int64
#: tensor), which a reader compares with the step ``nereus_meta.json`` gives.
STEP_KEY = "global_step"
#: In a model-stage's directory: the parameters stored as their fp32 master only -> their dtype names.
PARAMS_FROM_MASTERS = "params_from_masters.json"
#: Threads (each its own file) writing one rank's shards from host memory: 2.15 GB/s with 16 on an H200
#: host, 1.8 with 8, 0.7 with DCP's one (the disk takes 2.0; benchmarks/gpu_dcp_write.py).
WRITE_THREADS = 16
#: Model-stages :func:`save_states` writes at once: inside a finished 0.5B PPO run one save from host memory
#: wrote 1.5 GB/s of a disk that takes 2.0-2.5 (fsync'd), so its two 6 GB training units share it.
CONCURRENT_SAVES = 2
#: The default group the write groups were made in, and one gloo group per concurrent save (see
#: :func:`_write_groups`).
_WRITE_GROUPS: tuple[Any, list[dist.ProcessGroup | None]] | None = None


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= size
    return tuple(reversed(out))


def params_from_masters(schema: StateSchema, trains: bool) -> dict[str, str]:
    """The parameters a checkpoint of a unit stores as their fp32 master only -> their dtype names.

    Those of a training unit that have a master (bf16/fp16): each is its master rounded, because
    :class:`~nereus_lightning.models.optim.BoundedAdamW` copies every master into its parameter
    after a step and a fresh unit's master is the parameter upcast (``EMU.from_model`` refuses a given
    master that rounds to another value). Storing them too would write 2 more bytes per parameter
    (1 GB of a 0.5B training unit's 7 GB).
    """
    if not trains:
        return {}
    return {n: schema.dtype_name_of[n] for n in schema.names if MASTER_KEY in schema.optim_keys(n)}


def dcp_state_dict(emu: EMU) -> dict[str, Tensor]:
    """Every tensor of this rank's shards keyed ``"<key>/<global name>"``: DTensors for TP-cut tensors,
    plain tensors otherwise (a checkpoint holds all but :func:`params_from_masters`). A sharded replica
    at rest (row blocks: :attr:`EMU.row_keys`) gives DTensors on its ``(tp, shard)`` mesh
    (:func:`_row_state`).

    The values share storage with the EMU, so :func:`dcp.load` fills the EMU in place.
    """
    if emu.row_keys:
        return _row_state(emu)
    layout, pos = emu.layout, emu.position
    mesh = None
    if layout.tp > 1:
        inner = layout.pp * layout.tp  # a sharded unit's shard ranks each hold a whole (pp, tp) piece
        first = emu.unit.gpus.index(emu.rank) // inner * inner + pos.pp_rank * layout.tp
        tp_ranks = emu.unit.gpus[first : first + layout.tp]
        mesh = DeviceMesh.from_group(member_group(tp_ranks), emu.device.type)
    out: dict[str, Tensor] = {}
    for name, key, tensor in emu.tensors():
        dim = emu.schema.placements[name].tp_dim
        if mesh is not None and dim is not None and tensor.dim() > 0:
            shape = emu.schema.shape_of[name]
            tensor = DTensor.from_local(
                tensor,
                mesh,
                [Shard(dim)],
                run_check=False,
                shape=torch.Size(shape),
                stride=_contiguous_stride(shape),
            )
        out[f"{key}/{name}"] = tensor
    out["counters"] = emu.counters.as_tensor(emu.device)
    return out


def _row_state(emu: EMU) -> dict[str, Tensor]:
    """:func:`dcp_state_dict` of a sharded replica holding row blocks: each tensor a DTensor on the
    ``(tp, shard)`` mesh of its pipeline stage, ``[Shard(tp_dim) or Replicate(), Shard(0)]`` for a row
    block (the TP cut, then FSDP2's row blocks of it), ``Replicate()`` over the shard dim for a tensor
    every shard rank holds whole (the parameters below ZeRO-3). DCP records the global offsets, so the
    checkpoint loads at any layout by logical name, and nothing is gathered to write it."""
    layout, pos = emu.layout, emu.position
    at = [
        [emu.unit.gpus[(s * layout.pp + pos.pp_rank) * layout.tp + t] for s in range(layout.shard)]
        for t in range(layout.tp)
    ]
    groups = [member_group([row[emu.shard_rank] for row in at]), member_group(at[pos.tp_rank])]
    mesh = DeviceMesh.from_group(
        groups, emu.device.type, mesh=torch.tensor(at), mesh_dim_names=("tp", "shard")
    )
    out: dict[str, Tensor] = {}
    for name, key, tensor in emu.tensors():
        dim = emu.schema.placements[name].tp_dim
        if key != "step":
            tp = Shard(dim) if dim is not None else Replicate()
            rows = Shard(0) if key in emu.row_keys else Replicate()
            tensor = _on_mesh(tensor, mesh, (tp, rows), torch.Size(emu.schema.shape_of[name]))
        out[f"{key}/{name}"] = tensor
    out["counters"] = emu.counters.as_tensor(emu.device)
    return out


def _local_emus(model_stage: str) -> list[EMU]:
    return [emu for emu in registry().units.get(model_stage, {}).values() if emu is not None]


def save_state(model_stage: str, path: str | os.PathLike, weights: bool = True) -> None:
    """Save every live replica of ``model_stage`` to ``path`` (duplicate shards are written once).

    Without ``weights`` only the counters are written: for a model-stage whose weights another
    model-stage holds (see :meth:`~nereus_lightning.lightning.emu_state.EMUStates.save`).
    """
    save_states([(model_stage, path, weights)])


def save_states(saves: Sequence[tuple[str, str | os.PathLike, bool]], step: int | None = None) -> None:
    """:func:`save_state` for each ``(model_stage, path, weights)`` (collective; same list on every rank).

    ``step``: the global step, stored in each model-stage's state as :data:`STEP_KEY` (None: not stored).

    Three kinds of threads overlap the work:

    - One thread stages every unit that is on a GPU into page-locked host memory, in the given order:
      a 0.5B training unit stages 6 GB of fp32 masters and AdamW moments (~2 s on an H200 host, most of
      it locking the memory). A unit already in host memory (an idle one) is written from there.
    - :data:`CONCURRENT_SAVES` writers each write their share of ``saves`` in order: save ``i`` goes to
      writer ``i % CONCURRENT_SAVES``, so consecutive saves, such as the two training units a caller
      lists last, are written at once and share the disk (one DCP save alone reaches 1.5-2.2 GB/s of
      it). DCP's save is collective, so each writer saves over a process group of its own
      (:func:`_write_groups`): two saves on one group would interleave their collectives differently on
      different ranks.
    - One thread frees each unit's staged memory as soon as its write ends (unregistered, then unmapped:
      ~0.1 s per GB), while the writers go on; this function returns once everything it staged is
      freed, so no staged memory is left for the process's exit.

    At most ``CONCURRENT_SAVES + 1`` units are staged at once (those being written and the next one):
    for a 0.5B PPO job that is its two training units, 2 x 6 GB = 12 GB of page-locked host memory (the
    other model-stages are written from their own host memory or are counters only; see
    :meth:`~nereus_lightning.lightning.emu_state.EMUStates.save`).

    A failed save raises on every rank (DCP gathers every rank's failure), so every rank's writer stops at
    the same save; the other writer finishes its share (every rank does the same), memory staged for the
    saves not written is freed, and the first writer's failure is raised. A failure on one rank only
    (staging, ``params_from_masters.json``) leaves the other ranks waiting in DCP until the collective
    timeout, as it did before saves ran concurrently.

    A training unit's low-precision parameters are written as their masters only (see
    :func:`params_from_masters`); the caller makes sure each still is its master rounded
    (:func:`params_off_master`, as :meth:`~nereus_lightning.lightning.NereusStrategy.save_checkpoint` does).
    """
    states = [_unit_state(next(iter(_local_emus(stage)), None), weights) for stage, _, weights in saves]
    if step is not None:
        states = [{**state, STEP_KEY: torch.tensor([step], dtype=torch.int64)} for state in states]
    writers = max(1, min(CONCURRENT_SAVES, len(saves)))
    groups = _write_groups()[:writers]  # created here, on every rank in the same order, before any thread
    room = threading.Semaphore(writers + 1)  # staged units alive at once
    freeing = ThreadPoolExecutor(1, thread_name_prefix="nereus-unmap")
    try:
        with (
            ThreadPoolExecutor(1, thread_name_prefix="nereus-staging") as staging,
            ThreadPoolExecutor(writers, thread_name_prefix="nereus-save") as writing,
        ):
            ready = [staging.submit(_stage, state, room) for state in states]
            jobs = [(*save, staged) for save, staged in zip(saves, ready, strict=True)]
            written = [
                writing.submit(_write_share, jobs[writer::writers], group, freeing)
                for writer, group in enumerate(groups)
            ]
            failures = [future.exception() for future in written]  # waits for every writer
    finally:
        freeing.shutdown(wait=True)  # every staged unit unmapped (the writers handed each over)
    failure = next((f for f in failures if f is not None), None)
    if failure is not None:
        raise failure


class _Staged:
    """One unit's state as it is written, and the page-locked host memory it was staged into (None: written
    from where it is).

    Its future and its writer hold it until they finish; :meth:`free` takes the state and the memory out
    of it, so that the freeing thread drops their last references.
    """

    def __init__(self, state: dict[str, Any], block: HostBlock | None, room: threading.Semaphore) -> None:
        self.state, self.block, self._room = state, block, room

    def free(self) -> None:
        """Unregister the staged memory (after the copies that filled it), unmap it, give its room back.

        Called once the write has returned (DCP keeps no reference to the state), so the mapping is unmapped
        here, on the calling thread, when the references below go.
        """
        state, block = self.state, self.block
        self.state, self.block = {}, None
        try:
            if block is not None:
                block.release()
            del state, block  # the last references: the mapping is unmapped now
        finally:
            self._room.release()


def _stage(state: dict[str, Any], room: threading.Semaphore) -> _Staged:
    """``state`` staged in host memory (:func:`_on_host`) once fewer than the bound are staged."""
    room.acquire()
    try:
        return _Staged(*_on_host(state), room)
    except BaseException:
        room.release()
        raise


def _write_share(
    share: Sequence[tuple[str, str | os.PathLike, bool, Future[_Staged]]],
    group: dist.ProcessGroup | None,
    freeing: ThreadPoolExecutor,
) -> None:
    """Write each ``(model_stage, path, weights, staged)`` of one writer's share in order, over ``group``.

    Each unit's staged memory goes to ``freeing`` as soon as its write ends. After a failure nothing more
    is written (the failure was raised on every rank), but the rest of the share still leaves the staging
    thread: units not staged yet are cancelled, staged ones freed, so that staging never waits for room
    that would not come back. The failure is raised at the end.
    """
    failure: BaseException | None = None
    for model_stage, path, weights, ready in share:
        if failure is not None:
            if not ready.cancel():  # being staged or staged: free it
                with suppress(Exception):
                    freeing.submit(ready.result().free)
            continue
        try:
            staged = ready.result()
        except BaseException as exc:  # staging failed
            failure = exc
            continue
        try:
            if weights:
                _write_params_from_masters(model_stage, path)
            save_tensors(staged.state, path, process_group=group)
        except BaseException as exc:
            failure = exc
        finally:
            freeing.submit(staged.free)
    if failure is not None:
        raise failure


def _write_groups() -> list[dist.ProcessGroup | None]:
    """One process group over every rank per concurrent save (:data:`CONCURRENT_SAVES`); Nones without
    torch.distributed.

    Created on the first save on every rank in the same order (each a world-collective ``new_group``),
    and kept for the default group's lifetime. gloo, as DCP recommends for its coordination: it moves
    pickled plans and results, no tensors, so it needs no GPU (the staged tensors are on the host anyway).
    """
    global _WRITE_GROUPS
    if not dist.is_initialized():
        return [None] * CONCURRENT_SAVES
    world = dist.group.WORLD
    if _WRITE_GROUPS is None or _WRITE_GROUPS[0] is not world:
        timeout = collective_timeout()
        _WRITE_GROUPS = (
            world,
            [dist.new_group(backend="gloo", timeout=timeout) for _ in range(CONCURRENT_SAVES)],
        )
    return list(_WRITE_GROUPS[1])


def _unit_state(emu: EMU | None, weights: bool) -> dict[str, Any]:
    """What :func:`save_state` and :func:`load_state` move for ``emu``: all of it but the parameters its
    masters give (:func:`params_from_masters`), or its counters only.
    """
    if emu is None:
        return {}
    state = dcp_state_dict(emu)
    if not weights:
        return {"counters": state["counters"]}
    derived = {f"param/{name}" for name in params_from_masters(emu.schema, emu.trains)}
    return {key: value for key, value in state.items() if key not in derived}


def _write_params_from_masters(model_stage: str, path: str | os.PathLike) -> None:
    """Rank 0 writes :data:`PARAMS_FROM_MASTERS` into ``path`` when the model-stage has such parameters
    (before DCP, whose ``.metadata`` comes last).
    """
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    reg = registry()
    derived = params_from_masters(reg.schema(model_stage), reg.trains[model_stage])
    if derived:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, PARAMS_FROM_MASTERS), "w") as f:
            json.dump({"params_from_masters": derived}, f)


def read_params_from_masters(directory: str | os.PathLike) -> dict[str, torch.dtype]:
    """The parameters ``directory`` (one model-stage) stores as their fp32 master only -> their dtypes.

    Empty when it has no :data:`PARAMS_FROM_MASTERS` (checkpoints before it existed hold every
    parameter); a damaged file raises :class:`CheckpointError` naming it.
    """
    file = Path(directory) / PARAMS_FROM_MASTERS
    if not file.is_file():
        return {}
    try:
        dtypes: dict[str, torch.dtype] = {}
        for name, dtype_name in json.loads(file.read_text())["params_from_masters"].items():
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{name}: {dtype_name!r} is not a torch dtype")
            dtypes[name] = dtype
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: damaged ({type(exc).__name__}: {exc})") from exc
    return dtypes


def _on_host(state: dict[str, Any]) -> tuple[dict[str, Any], HostBlock | None]:
    """``state`` with its GPU tensors copied into page-locked host memory, and that memory (release it).

    DCP's writer threads would copy GPU tensors out one at a time through pageable memory (1.4 GB/s
    on an H200 host); one registered :class:`~nereus_lightning.emu.host.HostBlock` takes them at
    the link's speed (``benchmarks/gpu_dcp_write.py``).
    """
    on_gpu = [k for k, v in state.items() if isinstance(v, Tensor) and v.device.type == "cuda"]
    if not on_gpu:
        return state, None
    device = state[on_gpu[0]].device
    with torch.cuda.device(device):  # on the staging thread too
        block = HostBlock([_local(state[k]) for k in on_gpu], pin=True)
        staged = dict(state)
        for key, host in zip(on_gpu, block.tensors, strict=True):
            host.copy_(_local(state[key]), non_blocking=block.pinned)
            staged[key] = _with_local(state[key], host)
        torch.cuda.synchronize(device)
    return staged, block


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _with_local(tensor: Tensor, local: Tensor) -> Tensor:
    """``local`` in ``tensor``'s place: a DTensor of the same mesh, placements and global shape."""
    if not isinstance(tensor, DTensor):
        return local
    mesh, placements = tensor.device_mesh, tensor.placements
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


def save_tensors(
    state: dict[str, Any], path: str | os.PathLike, process_group: dist.ProcessGroup | None = None
) -> None:
    """``dcp.save`` of ``state`` into the directory ``path``, collective over ``process_group`` (None: the
    default group); a failure raises a :class:`CheckpointError`, and so does a save whose metadata does not
    cover every tensor with data (:func:`read_dcp_metadata`: DCP's writer threads other than the first lose
    their errors, torch 2.13).
    """
    tensors = sum(isinstance(v, Tensor) for v in state.values())
    writer = FileSystemWriter(os.fspath(path), thread_count=max(1, min(WRITE_THREADS, tensors)))
    _keep_writer_thread_errors()
    seen = len(_WRITER_THREAD_ERRORS)
    with _named_failures(path):
        dcp.save(state, storage_writer=writer, process_group=process_group)
    try:  # every rank reads the same file, so every rank raises the same error
        read_dcp_metadata(path)
    except CheckpointError as exc:
        lost = _WRITER_THREAD_ERRORS[seen:]
        cause = (
            f"{type(lost[0]).__name__}: {lost[0]}" if lost else "a writer thread failed, e.g. on a full disk"
        )
        raise CheckpointError(f"{path}: not every tensor was written ({cause}): {exc}") from exc


#: Errors of DCP's writer threads other than its first, which DCP drops (torch 2.13): kept, not printed.
_WRITER_THREAD_ERRORS: list[BaseException] = []


def _keep_writer_thread_errors() -> None:
    """Route the errors of DCP's writer threads into :data:`_WRITER_THREAD_ERRORS` (once per process)."""
    previous = threading.excepthook
    if getattr(previous, "nereus_keeps_dcp_errors", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.thread is not None and "_write_files_from_queue" in args.thread.name and args.exc_value:
            _WRITER_THREAD_ERRORS.append(args.exc_value)
        else:
            previous(args)

    hook.nereus_keeps_dcp_errors = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def load_state(emu: EMU | None, path: str | os.PathLike, weights: bool = True) -> None:
    """Fill ``emu``'s shards (any layout) and counters from a checkpoint written by :func:`save_state`; None
    off the unit. Without ``weights`` only the counters are read.
    """
    state = _unit_state(emu, weights)
    load_tensors(state, path)
    if emu is not None:
        emu.counters = Counters.from_tensor(state["counters"])
        if weights:
            _round_masters_into_params(emu)
    if dist.is_initialized():
        dist.barrier()


def _round_masters_into_params(emu: EMU) -> None:
    """Each parameter of :func:`params_from_masters` from its loaded master, rounded as the optimizer
    step rounds it (``param.copy_(master)``).
    """
    with torch.no_grad():
        for name in params_from_masters(emu.schema, emu.trains):
            if name in emu.params:  # (this rank's pipeline stage)
                emu.params[name].copy_(emu.optim_state[name][MASTER_KEY])


def load_tensors(state: dict[str, Any], path: str | os.PathLike, alone: bool = False) -> None:
    """``dcp.load`` through :class:`SafeReader`; a failure raises a :class:`CheckpointError` naming the file.

    Collective over the default group, or on this process only with ``alone`` (e.g. rank 0 exporting).
    """
    with _named_failures(path), warnings.catch_warnings():
        # DCP warns that it "assumes the intent is to load in a single process": with ``alone`` it is.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, storage_reader=SafeReader(os.fspath(path)), no_dist=alone)


@contextmanager
def _named_failures(path: str | os.PathLike) -> Iterator[None]:
    """DCP's ``CheckpointException`` (every rank's failures, raised on all ranks) as one
    :class:`CheckpointError`.
    """
    try:
        yield
    except CheckpointException as exc:
        failures = {rank: error for rank, (error, _) in exc.failures.items()}
        named = next((e for e in failures.values() if isinstance(e, CheckpointError)), None)
        if named is not None:
            raise CheckpointError(str(named)) from exc
        rank, error = next(
            ((r, e) for r, e in failures.items() if isinstance(e, OSError)), next(iter(failures.items()))
        )
        raise CheckpointError(f"{path}: {type(error).__name__} on rank {rank}: {error}") from exc


def nonfinite_names(tensors: Iterable[tuple[str, Tensor]]) -> list[str]:
    """The names of the floating-point ``tensors`` holding a NaN or an infinity (one device sync in all).

    A tensor is finite when its least and greatest elements are (a NaN propagates into both): one
    reading pass, where ``isfinite(t).all()`` also writes a flag per element.
    """
    named = [(name, t) for name, t in tensors if t.is_floating_point() and t.numel()]
    if not named:
        return []
    finite = torch.stack([torch.isfinite(torch.stack(torch.aminmax(t))).all() for _, t in named]).tolist()
    return [name for (name, _), ok in zip(named, finite, strict=True) if not ok]


def nonfinite_tensors(model_stage: str) -> list[str]:
    """This rank's state tensors of ``model_stage`` holding a NaN or an infinity: ``name`` or ``name
    (optimizer key)``.
    """
    return nonfinite_names(
        (name if key == "param" else f"{name} ({key})", tensor)
        for emu in _local_emus(model_stage)
        for name, key, tensor in emu.tensors()
    )


def params_off_master(model_stage: str) -> list[str]:
    """This rank's parameters of ``model_stage`` that are not their fp32 master rounded, bit for bit (one
    device sync in all).

    A checkpoint stores such a parameter as its master only (:func:`params_from_masters`), so it
    would not give one of these back: something changed it outside the optimizer step.
    """
    named = [
        (name, _rows_of(emu, emu.params[name]), emu.optim_state[name][MASTER_KEY])
        for emu in _local_emus(model_stage)
        for name in params_from_masters(emu.schema, emu.trains)
        if name in emu.params
    ]
    if not named:
        return []
    differs = torch.stack([off_master(param, master) for _, param, master in named]).tolist()
    return [name for (name, _, _), bad in zip(named, differs, strict=True) if bad]


def _rows_of(emu: EMU, param: Tensor) -> Tensor:
    """``param`` as the AdamW state holds it: this shard rank's row block where the state is row blocks
    and the parameter whole (at rest below ZeRO-3), else itself."""
    if MASTER_KEY in emu.row_keys and "param" not in emu.row_keys:
        return cut_rows(param, emu.layout.shard, emu.shard_rank)
    return param


class SafeReader(FileSystemReader):
    """DCP's file-system reader, reading the metadata with :func:`read_dcp_metadata` and naming a file that
    fails.
    """

    def read_metadata(self) -> Metadata:  # no rank-local fallback: Nereus writes one .metadata
        """The checked metadata (see :func:`read_dcp_metadata`)."""
        metadata = read_dcp_metadata(self.path)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> TorchFuture[None]:
        """DCP's read, one data file at a time, so that an error names the file it came from."""
        for name, items in _by_file(plan.items, self.storage_data).items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as exc:
                raise CheckpointError(
                    f"{Path(self.path) / name}: damaged ({type(exc).__name__}: {exc})"
                ) from exc
        done: TorchFuture[None] = TorchFuture()
        done.set_result(None)
        return done


def _by_file(items: list[Any], storage_data: dict[Any, Any]) -> dict[str, list[Any]]:
    groups: dict[str, list[Any]] = {}
    for item in items:
        groups.setdefault(storage_data[item.storage_index].relative_path, []).append(item)
    return groups


def zero_state_dict(shards: ZeroShards, mesh_ranks: Tensor) -> dict[str, Tensor]:
    """A sharded replica's state on this rank, keyed as :func:`dcp_state_dict` keys an EMU's.

    Each row block is a DTensor on the ``(tp, shard)`` mesh ``mesh_ranks`` of this pipeline stage
    (``mesh_ranks[t][s]``: the rank at TP rank ``t`` of shard rank ``s``), ``[Shard(tp_dim), Shard(0)]``:
    the TP cut, then FSDP2's row blocks of it. DCP records each with its global offsets, so a
    checkpoint written at one shard degree loads at any other, or unsharded, by logical name. Below
    ZeRO-3 the parameters are whole on every shard rank (``Replicate()`` over the shard dim). The
    values share storage with the replica's tensors, so :func:`dcp.load` fills them in place.
    """
    module, group = shards.module, shards.shards
    schema = StateSchema.of(module.config)
    tp_group = member_group(mesh_ranks[:, group.shard_rank].tolist())
    device = next(iter(shards.blocks.values())).device
    mesh = DeviceMesh.from_group(
        [tp_group, group.group], device.type, mesh=mesh_ranks, mesh_dim_names=("tp", "shard")
    )
    out: dict[str, Tensor] = {}
    for name, block in shards.blocks.items():
        shape = torch.Size(schema.shape_of[name])
        dim = schema.placements[name].tp_dim
        tp = Shard(dim) if dim is not None else Replicate()
        if group.zero == 3:
            out[f"param/{name}"] = _on_mesh(block.detach(), mesh, (tp, Shard(0)), shape)
        else:
            out[f"param/{name}"] = _on_mesh(shards.named[name].detach(), mesh, (tp, Replicate()), shape)
        for key, tensor in shards.optimizer.state[block].items():
            out[f"{key}/{name}"] = tensor if key == "step" else _on_mesh(tensor, mesh, (tp, Shard(0)), shape)
    return out


def _on_mesh(local: Tensor, mesh: DeviceMesh, placements: tuple[Any, ...], shape: torch.Size) -> DTensor:
    """``local`` as its part of a DTensor of global ``shape`` (contiguous) placed by ``placements``."""
    stride = _contiguous_stride(tuple(shape))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
