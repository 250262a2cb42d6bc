"""DeepSpeed universal checkpoints in and out of a nereus model-stage checkpoint, by logical name.

A universal checkpoint is what DeepSpeed's ``ds_to_universal`` writes from a ZeRO checkpoint: a folder
``<root>/<tag>/`` (``<root>/latest_universal`` names the tag) holding, for each parameter of the module
``deepspeed.initialize`` wrapped, ``zero/<name>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt`` (each
``{"param": full tensor, ...}``) and ``step.pt``; ``zero/optimizer_state.pt`` (the optimizer's global
state and param groups) and ``mp_rank_00_model_states.pt`` (the engine's counters). DeepSpeed resumes it
at any data-parallel size (``"checkpoint": {"load_universal": true}``).

A nereus model-stage directory (``emu/<model_stage>/`` of a checkpoint) holds the same state through DCP
by logical name (``param/``, ``master/``, ``exp_avg/``, ``exp_avg_sq/``, ``step/<name>``), which a unit
of any layout loads (:func:`~nereus_lightning.emu.dcp_state.load_state`, or a sharded replica through
:func:`~nereus_lightning.emu.dcp_state.zero_state_dict`). The logical names are the transformers model's
parameter names, those of a transformers model wrapped by ``deepspeed.initialize``; a fused projection
(one weight for q|k|v) keeps its rows in group order in nereus (``models.sharding.tp_slices``).

The DeepSpeed files are read with ``torch.load(weights_only=True)``: tensors, numbers and plain
containers only. The files this module writes are what ``load_universal`` reads; the optimizer's
hyper-parameters are DeepSpeed's own (its config or optimizer), as nereus keeps them in its config.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nereus_lightning.emu.dcp_state import (
    DCP_METADATA,
    PARAMS_FROM_MASTERS,
    STEP_KEY,
    load_tensors,
    read_dcp_metadata,
    save_tensors,
)
from nereus_lightning.emu.unit import Counters
from nereus_lightning.lightning.hf_export import logical_params, model_of
from nereus_lightning.models.optim import MASTER_KEY, needs_master
from nereus_lightning.models.sharding import placement, tp_plan_of, tp_slices
from nereus_lightning.spec.errors import CheckpointError

#: ``ds_to_universal``'s file naming the newest tag, beside the tag folders.
LATEST = "latest_universal"
#: The per-parameter folders' parent in a tag folder, and the files of each parameter (``fp32`` first).
ZERO_DIR = "zero"
STATES = ("fp32", "exp_avg", "exp_avg_sq")
#: The engine's counters in a tag folder (DeepSpeed's name for data-parallel rank 0 of model-parallel rank 0).
MODEL_STATES = "mp_rank_00_model_states.pt"
OPTIMIZER_STATE = "optimizer_state.pt"
#: The DeepSpeed version whose universal format this module writes (``_load_global_state`` requires one).
DS_VERSION = "0.19.8"
#: Param groups written into ``optimizer_state.pt``: ``load_universal`` loads the state of as many of the
#: engine's param groups as the file lists, and sets each group's keys from the file's; empty groups leave
#: DeepSpeed's own hyper-parameters, and enough of them cover every engine's groups.
PARAM_GROUPS = 64


def universal_folder(path: str | os.PathLike) -> Path:
    """The tag folder of the universal checkpoint ``path``: the tag folder itself, or a root whose
    ``latest_universal`` names one; anything else raises :class:`CheckpointError` saying what was expected.
    """
    path = Path(path)
    if (path / LATEST).is_file():
        path = path / (path / LATEST).read_text().strip()
    if not (path / ZERO_DIR).is_dir():
        raise CheckpointError(
            f"{path}: not a DeepSpeed universal checkpoint: expected {path / ZERO_DIR}/<parameter>/fp32.pt "
            f"(the folder ds_to_universal --output_folder wrote) or {Path(path) / LATEST} naming one"
        )
    return path


def _load(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"{file}: cannot be read as tensors and plain data ({type(exc).__name__}: {str(exc)[:200]})"
        ) from exc


def read_universal(path: str | os.PathLike) -> dict[str, dict[str, Tensor]]:
    """Every parameter of the universal checkpoint ``path`` -> its ``fp32``, ``exp_avg``, ``exp_avg_sq``
    (full tensors, fp32) and ``step`` (0-d fp32); a parameter without optimizer state (no gradient yet)
    gets zero moments and step 0, as a fresh AdamW.
    """
    folder = universal_folder(path) / ZERO_DIR
    out: dict[str, dict[str, Tensor]] = {}
    for param_dir in sorted(p for p in folder.iterdir() if p.is_dir()):
        if not (param_dir / "fp32.pt").is_file():
            raise CheckpointError(f"{param_dir}: no fp32.pt (ds_to_universal writes one per parameter)")
        states = {}
        for state in STATES:
            file = param_dir / f"{state}.pt"
            states[state] = _tensor_of(file, _load(file)) if file.is_file() else None
        fp32 = states["fp32"]
        assert fp32 is not None
        entry = {k: (t if t is not None else torch.zeros_like(fp32)) for k, t in states.items()}
        step = _load(param_dir / "step.pt") if (param_dir / "step.pt").is_file() else 0
        entry["step"] = torch.as_tensor(step, dtype=torch.float32).reshape(())
        out[param_dir.name] = entry
    if not out:
        raise CheckpointError(f"{folder}: holds no parameter folders (<name>/fp32.pt)")
    return out


def _tensor_of(file: Path, value: Any) -> Tensor:
    """The full fp32 tensor of one universal state file (``{"param": tensor, ...}``)."""
    tensor = value.get("param") if isinstance(value, dict) else None
    if not isinstance(tensor, Tensor):
        raise CheckpointError(
            f"{file}: holds no 'param' tensor (a universal state file holds {{'param': ...}})"
        )
    return tensor.detach().to(torch.float32)


def config_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """The logical parameters of a transformers model of ``config`` (tied ones once) -> their shapes."""
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in model_of(config, torch.float32).named_parameters()}


def check_names(
    source: str, have: Mapping[str, tuple[int, ...]], want: Mapping[str, tuple[int, ...]]
) -> None:
    """Refuse ``source``'s parameters (``have``) unless they are the model's (``want``): same names, same
    shapes; the error names the differences."""
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    wrong = [
        f"{n} {have[n]} (the model: {want[n]})" for n in sorted(set(have) & set(want)) if have[n] != want[n]
    ]
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{source}: its parameters are not those of the model config: missing {missing[:6]}, "
            f"unexpected {unexpected[:6]}, other shapes {wrong[:6]} ({len(missing)}, {len(unexpected)} and "
            f"{len(wrong)} in all); a module wrapping the transformers model in another (a prefix) or "
            "another config does not map by name"
        )


def _nereus_order(config: Any) -> dict[str, list[int]]:
    """The fused parameters of ``config``'s family -> the model's rows in nereus' (group) order."""
    plan, out = tp_plan_of(config), {}
    for name, shape in config_shapes(config).items():
        p = placement(name, plan)
        if p.fused is not None:
            rows = tp_slices(shape, p, 1, 0)[0]
            assert isinstance(rows, list)
            out[name] = rows
    return out


def import_universal(
    source: str | os.PathLike, output: str | os.PathLike, config: Any, dtype: torch.dtype = torch.float32
) -> Path:
    """Write the universal checkpoint ``source`` as a nereus model-stage directory ``output`` (one process).

    ``config``: the transformers config of the model DeepSpeed trained (its names and shapes must be the
    checkpoint's). ``dtype``: the parameters' dtype in the nereus unit; below fp32 each is stored as its
    fp32 master only (``params_from_masters.json``), as a nereus training unit saves it. The step stored
    with the tensors (and the counters' optimizer step) is the parameters' AdamW step.
    """
    output = Path(output)
    if output.exists():  # before the whole checkpoint is read
        raise CheckpointError(f"{output}: exists; name a new folder for the nereus model-stage checkpoint")
    folder = universal_folder(source)
    state = read_universal(folder)
    check_names(
        str(folder / ZERO_DIR), {n: tuple(s["fp32"].shape) for n, s in state.items()}, config_shapes(config)
    )
    order = _nereus_order(config)
    weight_key = MASTER_KEY if needs_master(dtype) else "param"
    out: dict[str, Tensor] = {}
    for name, entry in state.items():
        rows = order.get(name)
        for key, tensor in entry.items():
            tensor = tensor[rows] if rows is not None and tensor.dim() else tensor
            out[f"{weight_key if key == 'fp32' else key}/{name}"] = tensor.contiguous()
    step = int(max(float(e["step"]) for e in state.values()))
    out["counters"] = Counters(optimizer_step=step, update_count=step).as_tensor()
    out[STEP_KEY] = torch.tensor([step], dtype=torch.int64)
    output.mkdir(parents=True)
    if needs_master(dtype):
        dtype_name = str(dtype).removeprefix("torch.")
        (output / PARAMS_FROM_MASTERS).write_text(
            json.dumps({"params_from_masters": dict.fromkeys(state, dtype_name)})
        )
    with (
        warnings.catch_warnings()
    ):  # DCP warns that it "assumes the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        save_tensors(out, output)
    return output


def read_stage(stage_dir: str | os.PathLike) -> dict[str, dict[str, Tensor]]:
    """A nereus model-stage directory's logical state, full size, on this process: per parameter its fp32
    weight (``fp32``: the master, else the parameter), moments and step (the universal checkpoint's keys)."""
    stage_dir = os.fspath(stage_dir)
    stored: Mapping[str, Any] = read_dcp_metadata(stage_dir).state_dict_metadata
    params = logical_params(stage_dir)
    keys = [k for k in stored if k.split("/", 1)[0] in (MASTER_KEY, "exp_avg", "exp_avg_sq", "step")]
    missing = [n for n in params if f"exp_avg/{n}" not in stored or f"step/{n}" not in stored]
    if missing:
        raise CheckpointError(
            f"{os.path.join(stage_dir, DCP_METADATA)}: holds no AdamW state for {missing[:6]}; only a "
            "training model-stage (e.g. emu/actor_train) has the optimizer state a DeepSpeed checkpoint needs"
        )
    box = {k: torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype) for k in keys}
    load_tensors(box, stage_dir, alone=True)
    out = {}
    for name, param in params.items():
        master = box.get(f"{MASTER_KEY}/{name}")
        out[name] = {
            "fp32": (master if master is not None else param).to(torch.float32),
            "exp_avg": box[f"exp_avg/{name}"].to(torch.float32),
            "exp_avg_sq": box[f"exp_avg_sq/{name}"].to(torch.float32),
            "step": box[f"step/{name}"].to(torch.float32).reshape(()),
        }
    return out


def export_universal(
    stage_dir: str | os.PathLike, output: str | os.PathLike, config: Any, tag: str | None = None
) -> Path:
    """Write the nereus model-stage directory ``stage_dir`` as a universal checkpoint ``output/<tag>``
    (``output/latest_universal`` names it), which a DeepSpeed engine wrapping a transformers model of
    ``config`` resumes with ``load_universal``. ``tag``: None gives ``global_step<step>``; returns the
    tag folder.
    """
    state = read_stage(stage_dir)
    shapes = config_shapes(config)
    check_names(os.fspath(stage_dir), {n: tuple(s["fp32"].shape) for n, s in state.items()}, shapes)
    step = int(max(float(e["step"]) for e in state.values()))
    root = Path(output)
    folder = root / (tag or f"global_step{step}")
    if folder.exists():
        raise CheckpointError(f"{folder}: exists; name a new output folder or tag")
    order = _nereus_order(config)
    for name, entry in state.items():
        param_dir = folder / ZERO_DIR / name
        param_dir.mkdir(parents=True)
        for key in STATES:
            tensor = entry[key]
            if name in order:  # back to the model's row order
                tensor = torch.empty_like(tensor).index_copy_(0, torch.tensor(order[name]), tensor)
            torch.save({"param": tensor.contiguous(), "cat_dim": 0}, param_dir / f"{key}.pt")
        torch.save(entry["step"], param_dir / "step.pt")
    torch.save(_optimizer_state(), folder / ZERO_DIR / OPTIMIZER_STATE)
    torch.save(_model_states(state, order, shapes, step), folder / MODEL_STATES)
    (root / LATEST).write_text(folder.name)
    return folder


def _optimizer_state() -> dict[str, Any]:
    """``zero/optimizer_state.pt``: what ``load_universal`` reads besides the parameters; the loss scaler and
    clipping it leaves as they are when absent, so DeepSpeed's config decides them."""
    return {"ds_version": DS_VERSION, "param_groups": [{} for _ in range(PARAM_GROUPS)]}


def _model_states(
    state: Mapping[str, Mapping[str, Tensor]],
    order: Mapping[str, list[int]],
    shapes: Mapping[str, tuple[int, ...]],
    step: int,
) -> dict[str, Any]:
    """``mp_rank_00_model_states.pt``: the engine's counters and the module's fp32 weights (model order)."""
    module = {}
    for name, entry in state.items():
        fp32 = entry["fp32"]
        if name in order:
            fp32 = torch.empty_like(fp32).index_copy_(0, torch.tensor(order[name]), fp32)
        module[name] = fp32
    return {
        "module": module,
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [{n: torch.Size(s) for n, s in shapes.items()}],
        "frozen_param_shapes": {},
        "shared_params": {},
        "frozen_param_fragments": {},
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": step,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "ds_config": {},
        "ds_version": DS_VERSION,
    }
