"""Console and ``train.log`` lines, and the TensorBoard writer (a null writer off rank 0)."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainkit.config import flatten

LOGGER_NAME = "trainkit"
_FORMAT = "%(asctime)s %(message)s"
_DATEFMT = "%H:%M:%S"


def setup_logging(run_dir: str | Path | None, is_main: bool = True) -> logging.Logger:
    """Send trainkit's log lines to stdout and ``<run_dir>/train.log`` (rank 0 only).

    Idempotent per run directory, and it replaces handlers left by a previous run in the same
    process (Hydra multirun, notebooks). Other ranks print warnings and errors only.
    """
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    log_file = str(Path(run_dir).resolve() / "train.log") if run_dir and is_main else None
    if any(getattr(h, "_trainkit_file", "unset") == log_file for h in logger.handlers):
        return logger
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(_FORMAT, _DATEFMT)
    console = logging.StreamHandler(sys.stdout)
    console.setLevel(logging.INFO if is_main else logging.WARNING)
    handlers: list[logging.Handler] = [console]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(formatter)
        handler._trainkit_file = log_file  # type: ignore[attr-defined]
        logger.addHandler(handler)
    return logger


def log_to_file(lines: Sequence[str]) -> None:
    """Write ``lines`` to this process's ``train.log`` only (not the console), if it has one.

    The lines that end a failed run are printed to stderr; this keeps them in the log too, with
    the same timestamps as the log's other lines.
    """
    logger = logging.getLogger(LOGGER_NAME)
    for handler in logger.handlers:
        if isinstance(handler, logging.FileHandler):
            for line in lines:
                handler.handle(logger.makeRecord(LOGGER_NAME, logging.ERROR, __file__, 0, line,
                                                 None, None))


class NullWriter:
    """Stands in for SummaryWriter where nothing should be written (other ranks, no run dir)."""

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        pass

    def add_hparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_writer(run_dir: str | Path | None, is_main: bool = True) -> Any:
    """TensorBoard's ``SummaryWriter`` into ``<run_dir>/tb`` on rank 0, else a null writer."""
    if run_dir is None or not is_main:
        return NullWriter()
    from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when used

    return SummaryWriter(log_dir=str(Path(run_dir) / "tb"))


class Progress:
    """A live progress bar (ETA, samples/s, loss) when stdout is a terminal; nothing otherwise.

    Under nohup, ``tmux pipe-pane``, SLURM or ``> file`` the log lines alone report progress,
    with no carriage returns to clutter the file. While the bar shows, log lines are printed
    above it instead of through it.

    Example:
        >>> with Progress(total=1000, initial=0) as progress:  # doctest: +SKIP
        ...     progress.step()
    """

    def __init__(self, total: int, initial: int = 0, *, enabled: bool | None = None) -> None:
        self.enabled = sys.stdout.isatty() if enabled is None else enabled
        self.total, self.initial = total, initial
        self._bar: Any = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Progress:
        if self.enabled:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = self._stack.enter_context(tqdm(
                total=self.total, initial=self.initial, unit="step", dynamic_ncols=True,
                file=sys.stdout, leave=False, smoothing=0.05))
            self._stack.enter_context(logging_redirect_tqdm([logging.getLogger(LOGGER_NAME)]))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def step(self) -> None:
        if self._bar is not None:
            self._bar.update()

    def show(self, loss: float, samples_per_s: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_s:.0f}",
                                  refresh=False)


def write_hparams(run_dir: Path | None, config: Mapping[str, Any],
                   results: Mapping[str, float]) -> None:
    """The run's settings with its final metrics, for TensorBoard's HPARAMS tab (tb/hparams)."""
    if run_dir is None:
        return
    from torch.utils.tensorboard import SummaryWriter

    flat = {key: value if isinstance(value, (int, float, str, bool)) else str(value)
            for key, value in flatten(config).items()}
    with SummaryWriter(log_dir=str(run_dir / "tb" / "hparams")) as writer:
        writer.add_hparams(flat, {f"hparam/{k}": v for k, v in results.items()}, run_name=".")


def write_summary(run_dir: str | Path, summary: Mapping[str, Any]) -> None:
    """``<run_dir>/summary.json``, replaced atomically: readers never see half a file."""
    path = Path(run_dir) / "summary.json"
    tmp = path.with_name(".summary.json.tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)
