"""How log records reach the console: once each, rank 0's on the console, every rank's in the file.

Hydra's job logging of ``nereus-train`` (``configs/hydra/job_logging/nereus.yaml``) puts a console
and a file handler on the root logger, built from the classes here. Lightning also gives its own
loggers a console handler, so each of its records would be printed twice: :func:`propagate_to_root`
takes those away once the root has handlers. In a plain Python session (no root handlers),
:func:`console_handler` is what the package's own logger prints through. Nothing here imports
Lightning or torch: Hydra builds these objects before the app imports anything.
"""

from __future__ import annotations

import logging
import sys

# Libraries that attach a console handler to their own logger when they are imported.
LIBRARY_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "nereus_lightning")


def current_rank() -> int:
    """This process's global rank as Lightning knows it (0 before the strategy sets it)."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    return int(getattr(rank_zero_only, "rank", 0) or 0)


class RankFilter(logging.Filter):
    """Tags each record with its rank; passes every record of rank 0 and, from other ranks, those
    at ``every_rank_from`` or above (what every rank would repeat stays on rank 0).

    Args:
        every_rank_from: the lowest level shown from ranks other than 0 (a level name or number).
    """

    def __init__(self, every_rank_from: str | int = "WARNING") -> None:
        super().__init__()
        self.every_rank_from = (
            logging.getLevelName(every_rank_from) if isinstance(every_rank_from, str) else every_rank_from
        )

    def filter(self, record: logging.LogRecord) -> bool:
        """Tag ``record.rank``; keep it if it comes from rank 0 or is severe enough."""
        rank = current_rank()
        record.__dict__["rank"] = rank  # as logging's ``extra=`` sets a record's own fields
        return rank == 0 or record.levelno >= self.every_rank_from


class ConsoleFormatter(logging.Formatter):
    """The message alone for INFO; ``WARNING: ...`` above it; ``[rank k]`` in front on other ranks."""

    def format(self, record: logging.LogRecord) -> str:
        """One console line (plus a traceback when the record has one)."""
        text = super().format(record)
        if record.levelno >= logging.WARNING:
            text = f"{record.levelname}: {text}"
        rank = getattr(record, "rank", 0)
        return f"[rank {rank}] {text}" if rank else text


class ConsoleHandler(logging.StreamHandler):
    """A handler on whatever ``sys.stdout`` is when a record arrives.

    Rich's live progress bar swaps ``sys.stdout`` for a proxy that prints above the bar; a handler
    holding the original stream would write through the bar instead.
    """

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self):  # noqa: ANN201 - the stream of the moment
        return sys.stdout

    @stream.setter
    def stream(self, value: object) -> None:  # StreamHandler.__init__ sets it; the property wins
        pass


def console_handler() -> logging.Handler:
    """The console handler of a plain Python session: rank 0's records, warnings from every rank."""
    handler = ConsoleHandler()
    handler.addFilter(RankFilter("WARNING"))
    handler.setFormatter(ConsoleFormatter())
    return handler


def propagate_to_root() -> None:
    """Once the root logger has handlers (Hydra's), let the library loggers use only those.

    Call it after ``lightning`` is imported: its import adds the handler this removes. Without
    root handlers (a plain Python session) the libraries keep their own, or nothing would show.
    """
    if not logging.getLogger().handlers:
        return
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True
