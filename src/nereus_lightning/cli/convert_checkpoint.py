"""``nereus-convert-checkpoint``: older nereus checkpoints to the current format, and DeepSpeed universal
checkpoints in and out.

``upgrade`` (the default: ``nereus-convert-checkpoint <dir>...``) rewrites the pickled metadata of an
older checkpoint as JSON, once. Checkpoints written before format 1 keep their metadata in
``nereus_meta.pt``, a pickle, and resuming refuses them (loading a pickle can run any code it carries);
those of format 1 record their files' sizes only, not their content hashes, and resuming refuses them
too (their files cannot be verified). If you trust where such a checkpoint comes from, run this once
per directory, then resume as usual::

    nereus-convert-checkpoint outputs/<run>/checkpoints/last.ckpt
    python -m nereus_lightning.cli.convert_checkpoint outputs/<run>/checkpoints/last.ckpt

The pickle is read by an unpickler that builds only what those files held (dicts, lists, tensors,
Lightning's ``AttributeDict``, ``nereus_lightning`` dataclasses) and refuses any other global; the
DCP tensor files are checked as a resume checks them and left untouched. It writes
``nereus_meta.json`` (format 2: every file's SHA-256, as the files are now) next to them.

``from-deepspeed`` and ``to-deepspeed`` convert between a DeepSpeed universal checkpoint (the output of
DeepSpeed's ``ds_to_universal``) and a nereus model-stage directory, the logical state a unit of any
layout loads (:mod:`~nereus_lightning.lightning.deepspeed_universal`)::

    nereus-convert-checkpoint from-deepspeed ds_ckpt/universal --config hf_model/ --output new/actor_train
    nereus-convert-checkpoint to-deepspeed outputs/<run>/checkpoints/last.ckpt --output ds_universal
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import torch

from nereus_lightning.emu.dcp_state import DCP_METADATA, RestrictedUnpickler, read_dcp_metadata
from nereus_lightning.lightning.checkpoint import LEGACY_META_FILE, META_FILE, encode, write_metadata
from nereus_lightning.spec.errors import CheckpointError

_LEGACY_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("torch._utils", "_rebuild_tensor_v2"),  # a tensor from its storage, offset, size and stride
    ("lightning.fabric.utilities.data", "AttributeDict"),
    ("lightning.pytorch.utilities.parsing", "AttributeDict"),
}


def _storage_from_bytes(data: bytes) -> Any:
    """What ``torch.storage._load_from_bytes`` returns, read in weights-only mode."""
    return torch.load(io.BytesIO(data), weights_only=True)


def legacy_global(module: str, name: str) -> Any:
    """The globals an older ``nereus_meta.pt`` needs (None: refused, nothing imported)."""
    if (module, name) == ("torch.storage", "_load_from_bytes"):
        return _storage_from_bytes
    if (module, name) in _LEGACY_GLOBALS:
        return getattr(importlib.import_module(module), name)
    if module.split(".")[0] == "nereus_lightning":
        found = getattr(importlib.import_module(module), name, None)
        if isinstance(found, type) and dataclasses.is_dataclass(found):
            return found
    return None


def convert(directory: str | Path) -> Path:
    """Write a current ``nereus_meta.json`` for the older checkpoint ``directory``; returns the file written.

    A pickled ``nereus_meta.pt`` (before format 1) is read by the restricted unpickler; a format-1
    ``nereus_meta.json`` (file sizes only) is kept as it is. Either way every file's SHA-256 is recorded as it
    is now: run it only on checkpoints you trust.
    """
    directory = Path(directory)
    meta = directory / META_FILE
    if meta.is_file():
        return _upgrade(directory)
    legacy = directory / LEGACY_META_FILE
    if not legacy.is_file():
        raise CheckpointError(
            f"{legacy}: missing; {directory} is not a checkpoint of an older nereus-lightning"
        )
    try:
        with open(legacy, "rb") as f:
            checkpoint = RestrictedUnpickler(f, legacy_global).load()
    except Exception as exc:
        raise CheckpointError(f"{legacy}: cannot be converted ({type(exc).__name__}: {exc})") from exc
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{legacy}: holds a {type(checkpoint).__name__}, not a checkpoint dict")
    state = checkpoint.pop("nereus_state", "full")
    for metadata in sorted(directory.rglob(DCP_METADATA)):
        read_dcp_metadata(metadata.parent)
    write_metadata(directory, encode(dict(checkpoint)), state, step_tensors=False)
    return meta


def _upgrade(directory: Path) -> Path:
    """Rewrite a format-1 ``nereus_meta.json`` (sizes only) with every file's SHA-256 (else: refused)."""
    meta = directory / META_FILE
    try:
        doc = json.loads(meta.read_text())
        version, encoded, state = doc["format_version"], doc["checkpoint"], str(doc["state"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta}: damaged ({type(exc).__name__}: {exc})") from exc
    if version != 1:
        raise CheckpointError(f"{meta}: format version {version!r}, nothing to convert")
    for name, size in dict(doc.get("files", {})).items():  # the files are still those it recorded
        if not (directory / name).is_file() or (directory / name).stat().st_size != size:
            raise CheckpointError(
                f"{directory / name}: missing or not of its recorded {size} bytes; not converted"
            )
    for metadata in sorted(directory.rglob(DCP_METADATA)):
        read_dcp_metadata(metadata.parent)
    write_metadata(directory, encoded, state, step_tensors=False)
    return meta


#: The subcommands; an argument list that starts with none of them is ``upgrade``'s.
COMMANDS = ("upgrade", "from-deepspeed", "to-deepspeed")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nereus-convert-checkpoint",
        description="Convert checkpoints: older Nereus checkpoints to the current format (upgrade, the "
        "default), DeepSpeed universal checkpoints to and from a nereus model-stage directory.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    upgrade = commands.add_parser(
        "upgrade",
        help=f"rewrite the pickled {LEGACY_META_FILE} (or a format-1 {META_FILE}) of older Nereus "
        f"checkpoints as a current {META_FILE}, recording every file's SHA-256 (only for checkpoints "
        "you trust)",
    )
    upgrade.add_argument(
        "checkpoints", nargs="+", help="checkpoint directories (e.g. .../checkpoints/last.ckpt)"
    )
    into = commands.add_parser(
        "from-deepspeed",
        help="a DeepSpeed universal checkpoint (ds_to_universal's output) -> a nereus model-stage",
    )
    into.add_argument(
        "universal", help="the universal checkpoint: ds_to_universal's output folder or its parent"
    )
    into.add_argument("--config", required=True, help="the trained model's config.json (or its folder)")
    into.add_argument("--output", required=True, help="the new model-stage folder (e.g. <dir>/actor_train)")
    into.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="the nereus unit's parameter dtype; below fp32 the fp32 weights become its masters",
    )
    out = commands.add_parser(
        "to-deepspeed", help="a nereus checkpoint's training model-stage -> a DeepSpeed universal checkpoint"
    )
    out.add_argument("checkpoint", help="a nereus checkpoint directory, or one model-stage folder of one")
    out.add_argument("--output", required=True, help="the folder DeepSpeed's load_checkpoint is given")
    out.add_argument(
        "--model-stage", default="actor_train", help="the training stage in a checkpoint directory"
    )
    out.add_argument(
        "--config", help="the model's config.json or folder (default: the checkpoint's hf/<model>/)"
    )
    out.add_argument("--tag", help="the tag folder's name (default: global_step<step>)")
    return parser


def _config_of(path: str | Path) -> Any:
    """The transformers config in ``path`` (a config.json or its folder), refused with custom code."""
    from nereus_lightning.lightning.hf_export import checked_config

    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"{file}: missing; --config names a model's config.json or its folder")
    return checked_config(file)


def to_deepspeed(
    source: str | Path, output: str | Path, stage: str, config: str | None, tag: str | None
) -> Path:
    """``to-deepspeed``: the model-stage ``stage`` of the checkpoint ``source`` (verified first), or the
    model-stage folder ``source``, as a universal checkpoint under ``output``; returns its tag folder."""
    from nereus_lightning.lightning.checkpoint import read_checkpoint
    from nereus_lightning.lightning.deepspeed_universal import export_universal
    from nereus_lightning.lightning.hf_export import HF_DIR, TRAINED

    source = Path(source)
    if (source / META_FILE).is_file():
        root = Path(read_checkpoint(source).path)
        role = {s: r for r, s in TRAINED.items()}.get(stage)
        if role is None:
            raise CheckpointError(
                f"--model-stage {stage}: not a training stage ({', '.join(TRAINED.values())})"
            )
        stage_dir, default_config = root / "emu" / stage, root / HF_DIR / role / "config.json"
    elif (source / DCP_METADATA).is_file():
        stage_dir, default_config = source, None
    else:
        raise CheckpointError(
            f"{source}: not a nereus checkpoint: expected {source / META_FILE} (a checkpoint directory) or "
            f"{source / DCP_METADATA} (one model-stage folder of one, e.g. <checkpoint>/emu/actor_train)"
        )
    chosen = config if config is not None else default_config
    if chosen is None:
        raise CheckpointError(f"{source}: a model-stage folder alone; give the model's --config")
    return export_universal(stage_dir, output, _config_of(chosen), tag)


def _deepspeed(args: argparse.Namespace) -> str:
    """Run ``from-deepspeed`` or ``to-deepspeed``; returns what it wrote (a :class:`CheckpointError` names
    what failed)."""
    import torch

    from nereus_lightning.lightning.deepspeed_universal import import_universal

    if args.command == "from-deepspeed":
        config = _config_of(args.config)
        return (
            f"imported: {import_universal(args.universal, args.output, config, getattr(torch, args.dtype))}"
        )
    return f"exported: {to_deepspeed(args.checkpoint, args.output, args.model_stage, args.config, args.tag)}"


def main(argv: list[str] | None = None) -> None:
    """The ``nereus-convert-checkpoint`` entry point."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] not in COMMANDS and not argv[0].startswith("-"):
        argv = ["upgrade", *argv]  # the form older messages give: nereus-convert-checkpoint <dir>...
    args = _parser().parse_args(argv)
    failed = False
    if args.command == "upgrade":
        for path in args.checkpoints:
            try:
                print(f"converted: {convert(path)}")
            except CheckpointError as exc:
                print(f"nereus-convert-checkpoint: {exc}", file=sys.stderr)
                failed = True
    else:
        try:
            print(_deepspeed(args))
        except CheckpointError as exc:
            print(f"nereus-convert-checkpoint {args.command}: {exc}", file=sys.stderr)
            failed = True
    sys.exit(2 if failed else 0)


if __name__ == "__main__":
    main()
