"""Console and ``train.log`` lines, and the progress bar (metrics go to ``observe.sinks``)."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

LOGGER_NAME = "trainkit"
_FORMAT = "%(asctime)s %(message)s"
_DATEFMT = "%H:%M:%S"


class ConsoleHandler(logging.StreamHandler):
    """A console handler writing to whatever ``sys.stdout`` is when a line is logged: a notebook,
    a test's capture or a redirect may replace it after the handler was made."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stdout

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # StreamHandler's own assignment: the current sys.stdout is always used


class HeldFileHandler(logging.FileHandler):
    """``train.log`` of a folder that has one already: its lines are held until
    :func:`release_run_log` (the run is accepted), so a refused start leaves the file as it was."""

    def __init__(self, filename: str) -> None:
        super().__init__(filename, delay=True)  # not even opened until a line is written
        self.held: list[logging.LogRecord] | None = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.held is None:
            super().emit(record)
        else:
            self.held.append(record)

    def accept(self) -> None:
        """Write the held lines, and every later one as it comes."""
        held, self.held = self.held or [], None
        for record in held:
            super().emit(record)


def release_run_log() -> None:
    """The run is accepted (its checkpoint fits, its config passed): ``train.log`` gets the lines
    held so far (:class:`HeldFileHandler`)."""
    for handler in logging.getLogger(LOGGER_NAME).handlers:
        if isinstance(handler, HeldFileHandler):
            handler.accept()


def setup_logging(run_dir: str | Path | None, is_main: bool = True) -> logging.Logger:
    """Send trainkit's log lines to stdout and ``<run_dir>/train.log`` (rank 0 only).

    Where ``train.log`` exists already (an earlier run's), its new lines are held until
    :func:`release_run_log`: a start refused before then leaves the file untouched.

    Idempotent per run directory, and it replaces handlers left by a previous run in the same
    process (Hydra multirun, notebooks, sweeps): ``Trainer.fit`` calls it, so each run writes only
    to its own ``train.log``, and ``run_dir=None`` to stdout alone. Other ranks print warnings and
    errors only.
    """
    logger = logging.getLogger(LOGGER_NAME)
    if logger.level != logging.INFO:  # setLevel clears every logger's cache, even when equal
        logger.setLevel(logging.INFO)
    logger.propagate = False
    log_file = str(Path(run_dir).resolve() / "train.log") if run_dir and is_main else None
    if any(getattr(h, "_trainkit_file", "unset") == log_file for h in logger.handlers):
        return logger
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(_FORMAT, _DATEFMT)
    console = ConsoleHandler()
    console.setLevel(logging.INFO if is_main else logging.WARNING)
    handlers: list[logging.Handler] = [console]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(HeldFileHandler(log_file) if Path(log_file).exists()
                        else logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(formatter)
        handler._trainkit_file = log_file  # type: ignore[attr-defined]
        logger.addHandler(handler)
    return logger


def log_start(model: str, runtime: Any, total_steps: int, per_epoch: int, config: Any,
              batch_size: int | None, settings_text: str = "", *, precision: str | None = None,
              startup_s: float | None = None, setup_s: float | None = None,
              params: str = "") -> None:
    """The first line of a run: what trains where, for how long, with which global batch and
    precision (``auto``'s choice and why), ``params`` (what trains, what is frozen, the
    optimizer's groups), and how long the process took to get there."""
    k, world = config.accumulate_grad_batches, runtime.world_size
    batch = (f"global batch {batch_size * k * world} = batch {batch_size} x accumulate {k} x "
             f"world size {world}" if isinstance(batch_size, int) else
             f"accumulating {k} batches per step")
    # the process's wait for its first step where that is what it means, else the fit's own
    started = (f"; started in {startup_s:.1f} s" if startup_s is not None else
               f"; set up in {setup_s:.1f} s" if setup_s is not None else "")
    logging.getLogger(LOGGER_NAME).info(
        "training %s on %s for %d steps (%d per epoch), precision %s, %s%s%s", model,
        runtime.device, total_steps, per_epoch, precision or config.precision,
        batch + (f", {settings_text}" if settings_text else ""),
        f"; {params}" if params else "", started)


def log_window(scalars: Mapping[str, float], epoch: int, step: int, total_steps: int) -> None:
    """One logging step's line: loss, LR, throughput, data wait, memory."""
    memory = scalars.get("memory/cuda_peak_allocated_gib", scalars["memory/cpu_rss_gib"])
    tokens = scalars.get("throughput/tokens_per_s")  # token loaders (a language model's)
    logging.getLogger(LOGGER_NAME).info(
        "epoch %d step %d/%d loss %.4f lr %.3g %.0f samples/s%s data wait %.0f%% mem %.2f GiB",
        epoch, step, total_steps, scalars["train/loss"], scalars["train/lr"],
        scalars["throughput/samples_per_s"], "" if tokens is None else f" {tokens:.0f} tokens/s",
        scalars["time/data_wait_pct"], memory)


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


def in_notebook_kernel() -> bool:
    """Whether this runs in a Jupyter kernel (IPython's ZMQ shell), not a terminal or a script."""
    ipython = sys.modules.get("IPython")  # every kernel has imported it; never imported here
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None  # only the kernel's shell has one


def bar_kind(enabled: bool | None = None) -> str | None:
    """Which progress bar this process can show: ``"notebook"``, ``"terminal"`` or None.

    A widget in a Jupyter kernel with ipywidgets installed (tqdm's notebook frontend); a
    carriage-return bar when stdout is a terminal; None -- log lines alone -- otherwise, e.g.
    a kernel without ipywidgets, whose text output would keep every redraw of the bar.
    ``enabled=False`` asks for none, ``True`` for one even where stdout is not a terminal.
    """
    if enabled is False:
        return None
    if in_notebook_kernel():
        try:
            import ipywidgets  # noqa: F401  (tqdm.notebook draws with it)
        except ImportError:
            return "terminal" if enabled else None
        return "notebook"
    return "terminal" if enabled or sys.stdout.isatty() else None


class Progress:
    """A live progress bar (ETA, samples/s, loss) in a terminal or a notebook; nothing otherwise.

    Under nohup, SLURM or ``> file`` the log lines alone report progress (no carriage returns in
    the file). Log lines print above a terminal bar; in a notebook (:func:`bar_kind`) the bar is a
    widget and the lines follow it.

    Example:
        >>> with Progress(total=1000, initial=0) as progress:  # doctest: +SKIP
        ...     progress.step()
    """

    def __init__(self, total: int, initial: int = 0, *, enabled: bool | None = None) -> None:
        self.kind = bar_kind(enabled)
        self.enabled = self.kind is not None
        self.total, self.initial = total, initial
        self._bar: Any = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Progress:
        if self.kind == "notebook":
            from tqdm.notebook import tqdm as notebook_tqdm

            # leave=True: the bar stays in the cell's output, showing how far the run got
            self._bar = self._stack.enter_context(notebook_tqdm(
                total=self.total, initial=self.initial, unit="step", smoothing=0.05))
        elif self.kind == "terminal":
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
