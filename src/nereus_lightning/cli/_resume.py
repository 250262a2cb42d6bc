"""What ``nereus-train`` needs to resume a job as printed: the job's configuration in its checkpoints, the
config of a resume rebuilt from it, and one job per run folder.

Every checkpoint ``nereus-train`` writes holds ``nereus_job``: the job's command-line overrides (a path
given relative to where it started made absolute) and its resolved config. ``nereus-train
ckpt_path=<checkpoint>`` composes the stored overrides followed by the new ones (a key given again
takes the new value; the launch, ``trainer.num_nodes`` and ``trainer.devices``, is always the new
command's), so a GRPO job on a user's data resumes as that job; a new command that names
another algorithm or model than the checkpoint's is refused naming both, and one with nothing left
to train says so. ``ckpt_path=last`` resumes from the newest complete checkpoint of this run folder
(a requeued SLURM job), or starts afresh when there is none.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from nereus_lightning.spec.errors import NereusConfigError

JOB_KEY = "nereus_job"  # (what :class:`~nereus_lightning.lightning.checkpointing.JobRecord` stores)
LOCK_FILE = ".nereus-train.lock"
#: Config keys that say which job a checkpoint belongs to: a resume may not change them.
IDENTITY = (
    ("algorithm._target_", "algorithm"),
    ("actor.path", "actor.path"),
    ("actor.preset", "actor"),
    ("critic.path", "critic.path"),
    ("critic.preset", "critic.preset"),
    ("reward_model.path", "reward_model.path"),
    ("reward_model.preset", "reward_model.preset"),
)
#: Overrides a checkpoint does not store: where it came from and where it goes, and the launch (a resume runs
#: on the nodes and devices it is started on: checkpoints are layout-independent).
_NOT_STORED = ("ckpt_path", "output_dir", "trainer.num_nodes", "trainer.devices")


class NothingToDo(Exception):
    """The checkpoint already reached ``trainer.max_steps``: the run has no step to train."""


def override_key(override: str) -> str:
    """The key an override sets (``+a.b=1`` and ``a.b=2`` set ``a.b``)."""
    return override.split("=", 1)[0].lstrip("+~")


#: Keys whose values are paths: a relative one is stored relative to where the job started.
PATH_KEYS = (
    "data.train_files",
    "data.val_files",
    "data.tokenizer",
    "trainer.rollout_data_dir",
    "custom_reward_function.path",
)


def absolute_paths(overrides: Sequence[str], cwd: str) -> list[str]:
    """``overrides`` with every relative path made absolute against ``cwd``: the values of path keys
    (:data:`PATH_KEYS`, ``*.path``; lists too), and any other value naming an existing file there."""
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        path_key = override_key(key) in PATH_KEYS or override_key(key).endswith(".path")
        if sep and path_key and value.startswith("[") and value.endswith("]"):
            parts = [_absolute(v.strip(), cwd) for v in value[1:-1].split(",") if v.strip()]
            item = f"{key}=[{','.join(parts)}]"
        elif sep and value and (path_key or ("/" in value and (Path(cwd) / value).exists())):
            item = f"{key}={_absolute(value, cwd)}"
        out.append(item)
    return out


def _absolute(value: str, cwd: str) -> str:
    """``value`` against ``cwd`` when it is a relative path (a preset name, no such file: as it is)."""
    if os.path.isabs(value) or value in ("null", "None") or not (Path(cwd) / value).exists():
        return value
    return str((Path(cwd) / value).resolve())


def job_record(cfg: Any, overrides: Sequence[str]) -> dict[str, Any]:
    """What a checkpoint stores of the job: its overrides (paths absolute), resolved config and folder."""
    kept = [o for o in overrides if override_key(o) not in _NOT_STORED and not o.startswith("hydra")]
    config: Any = OmegaConf.to_container(cfg, resolve=True)
    for key, _ in IDENTITY:  # model folders as the resume composes them: absolute
        section, _, name = key.partition(".")
        node = config.get(section)
        if isinstance(node, dict) and name.endswith("path") and isinstance(node.get(name), str):
            node[name] = _absolute(node[name], os.getcwd())
    return {"overrides": absolute_paths(kept, os.getcwd()), "config": config, "cwd": os.getcwd()}


def stored_job(ckpt_path: str) -> tuple[dict[str, Any] | None, int]:
    """The job record and step of the checkpoint ``ckpt_path`` (its metadata only; None: no record)."""
    from nereus_lightning.lightning.checkpoint import read_metadata

    stored = read_metadata(ckpt_path)
    record = stored.checkpoint.get(JOB_KEY)
    return (record if isinstance(record, dict) else None), stored.global_step


def resolve_last(cfg: DictConfig) -> str | None:
    """``ckpt_path``, with ``last`` the newest complete checkpoint of this run folder (None: none there)."""
    from nereus_lightning.lightning.checkpoint import latest_checkpoint

    path = cfg.get("ckpt_path")
    if path != "last":
        return None if path is None else str(path)
    folder = Path(str(cfg.output_dir)) / "checkpoints"
    return latest_checkpoint(folder) if folder.is_dir() else None


def resumed_config(cfg: DictConfig, overrides: Sequence[str], compose: Any) -> tuple[DictConfig, list[str]]:
    """The config of this command: for ``ckpt_path=<checkpoint>``, the job stored in it, ``overrides`` on top.

    ``compose(overrides)`` composes the train config. Returns the config and the job's overrides (what
    the next checkpoints store). Raises :class:`NereusConfigError` naming both values when the command
    names another algorithm or model than the checkpoint, and :class:`NothingToDo` when the checkpoint
    is at or past ``trainer.max_steps``.
    """
    path = resolve_last(cfg)
    if path is None:
        with open_dict(cfg):
            cfg.ckpt_path = None  # (``last`` with no checkpoint yet: a fresh start)
        return cfg, list(overrides)
    record, step = stored_job(path)
    mine = [o for o in overrides if override_key(o) not in ("ckpt_path", "output_dir")]
    if record is not None:
        given = {override_key(o) for o in mine}
        merged = [o for o in record.get("overrides", []) if override_key(o) not in given] + mine
        output_dir = str(cfg.output_dir)
        cfg = compose([*merged, f"ckpt_path={path}", f"output_dir={output_dir}"])
        check_same_job(cfg, OmegaConf.create(record.get("config", {})), path)
        mine = merged
    else:
        with open_dict(cfg):
            cfg.ckpt_path = path
    check_steps_left(cfg, step, path)
    return cfg, mine


def check_same_job(cfg: DictConfig, stored: DictConfig, path: str) -> None:
    """Refuse, naming both values, a command whose algorithm or model differs from the checkpoint's job."""
    for key, shown in IDENTITY:
        want, have = OmegaConf.select(stored, key), OmegaConf.select(cfg, key)
        if want != have:
            raise NereusConfigError(
                f"{shown}: the checkpoint {path} was trained with {key}={want!r}, this command gives "
                f"{have!r}; "
                f"drop {shown}= to resume that job, or start a new run without ckpt_path"
            )


def check_steps_left(cfg: DictConfig, step: int, path: str) -> None:
    """Refuse a resume with no step left to train (:class:`NothingToDo` at ``max_steps``, an error below)."""
    max_steps = int(cfg.trainer.get("max_steps", -1))
    if max_steps < 0 or step < max_steps:
        return
    if step == max_steps:
        raise NothingToDo(
            f"nothing to train: the checkpoint {path} is at step {step} = trainer.max_steps; give a larger "
            f"trainer.max_steps (e.g. trainer.max_steps={2 * step}) to train on"
        )
    raise NereusConfigError(
        f"trainer.max_steps: {max_steps} is below the checkpoint's step {step} ({path}), so nothing would be "
        f"trained; give trainer.max_steps above {step}"
    )


class RunFolderLock:
    """A lock on a run folder for one job's lifetime (``flock`` on ``<folder>/.nereus-train.lock``).

    A second job started on a folder in use is refused at start, naming the job that holds it, instead of
    both crashing at their first save.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.path = Path(folder) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise :class:`NereusConfigError` naming its holder and the way out."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise NereusConfigError(
                f"hydra.run.dir: {self.path.parent} is in use by another nereus-train ({holder}); give this "
                "job "
                "its own run folder (hydra.run.dir=<new folder>), or wait for that one to end"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.ctime()}".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Give the lock back (the process's exit does too)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
