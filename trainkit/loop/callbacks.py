"""Callbacks: user code at five moments of a fit, and :class:`EarlyStopping` built on them.

A callback is any object with some of the five methods of :class:`Callback`; it need not
subclass anything. The Trainer resolves each callback's methods once per fit
(:class:`Callbacks`), so a step with no ``on_step_end`` to run pays nothing for the others.
A callback with ``state_dict()``/``load_state_dict()`` is saved in every checkpoint under its
``state_key`` (default: its class name) and restored on resume, so a resumed run is the same
run. Callbacks run on every rank; act on one with ``if trainer.runtime.is_main:``.
"""

from __future__ import annotations

import logging
import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from trainkit.core.errors import TrainkitError, one_line
from trainkit.observe.logging import log_to_file

log = logging.getLogger("trainkit")
EVENTS = ("on_fit_start", "on_step_end", "on_evaluation_end", "on_checkpoint", "on_fit_end")


class Callback(Protocol):
    """The events a callback may handle; define any subset (the others are not called).

    ``trainer`` is the :class:`~trainkit.Trainer`: ``trainer.state.global_step``,
    ``trainer.runtime.is_main`` (rank 0), ``trainer.request_stop(reason)``.

    Example:
        >>> class PrintBest:
        ...     def on_evaluation_end(self, trainer, results, step):
        ...         if trainer.runtime.is_main:
        ...             print(step, results["val/loss"])
        >>> Trainer(config, callbacks=[PrintBest()])  # doctest: +SKIP
    """

    def on_fit_start(self, trainer: Any) -> None:
        """Training is set up (resumed, if it resumes); no step taken yet."""

    def on_step_end(self, trainer: Any, step: int) -> None:
        """Optimizer step ``step`` is done (every step: keep it cheap, read no tensor)."""

    def on_evaluation_end(self, trainer: Any, results: Mapping[str, float], step: int) -> None:
        """An evaluation at step ``step`` gave ``results`` (``{"val/loss": ..., ...}``)."""

    def on_checkpoint(self, trainer: Any, path: Path | None, step: int) -> None:
        """A checkpoint of step ``step`` was written to ``path`` (None: this run saves none).
        With ``checkpoint.async_save`` it may still be on its way: ``trainer.checkpointer.wait()``
        first to read or copy it."""

    def on_fit_end(self, trainer: Any, summary: Mapping[str, Any]) -> None:
        """The run ended (completed, stopped or preempted) with ``summary``."""


class CallbackError(TrainkitError):
    """A callback raised: the run ends as on any user error (the traceback goes to train.log)."""


class Callbacks:
    """The fit's callbacks, their methods resolved once per event, and their saved states.

    Args:
        callbacks: objects with any of the :class:`Callback` methods.

    Raises:
        TrainkitError: two stateful callbacks with one ``state_key``.
    """

    def __init__(self, callbacks: Sequence[Any] = ()) -> None:
        self.callbacks = list(callbacks)
        self.stateful: dict[str, Any] = {}
        for callback in self.callbacks:
            if not (callable(getattr(callback, "state_dict", None))
                    and callable(getattr(callback, "load_state_dict", None))):
                continue
            key = state_key(callback)
            if key in self.stateful:
                raise TrainkitError(
                    f"two callbacks save their state under {key!r} ({_name(self.stateful[key])} "
                    f"and {_name(callback)}): give one a different state_key")
            self.stateful[key] = callback
        # per event, the bound methods to call: empty when no callback defines it
        self.handlers: dict[str, tuple[Callable[..., Any], ...]] = {
            event: tuple(getattr(c, event) for c in self.callbacks if _defines(c, event))
            for event in EVENTS}

    def fire(self, event: str, *args: Any) -> None:
        """Call every callback's ``event`` handler with ``args``; one that raises ends the run."""
        for handler in self.handlers[event]:
            try:
                handler(*args)
            except TrainkitError:
                raise  # already one line saying what to do (EarlyStopping's unknown monitor)
            except Exception as err:
                # the console gets one line; train.log the traceback, to find the bug by
                log_to_file("".join(traceback.format_exception(err)).splitlines())
                raise CallbackError(
                    f"callback {_name(getattr(handler, '__self__', handler))} raised in {event}: "
                    f"{type(err).__name__}: {one_line(err, 80)} (traceback in train.log)"
                ) from err

    def state_dict(self) -> dict[str, Any]:
        """Each stateful callback's state under its key."""
        return {key: callback.state_dict() for key, callback in self.stateful.items()}

    def load_state_dict(self, saved: Mapping[str, Any] | None) -> None:
        """Restore what :meth:`state_dict` saved; a callback the checkpoint lacks starts fresh."""
        saved = saved or {}
        for key, callback in self.stateful.items():
            if key in saved:
                callback.load_state_dict(saved[key])
            else:
                log.warning("the checkpoint has no state for callback %s: it starts fresh", key)


def state_key(callback: Any) -> str:
    """The name a stateful callback's state is saved under: ``state_key``, else its class name."""
    return str(getattr(callback, "state_key", None) or type(callback).__name__)


def _defines(callback: Any, event: str) -> bool:
    """Whether ``callback`` has its own ``event`` method (not :class:`Callback`'s empty one)."""
    method = getattr(type(callback), event, None)
    own = getattr(callback, event, None)
    return callable(own) and method is not getattr(Callback, event)


def _name(callback: Any) -> str:
    return type(callback).__name__


class EarlyStopping:
    """Stop the run when ``monitor`` has not improved for ``patience`` evaluations.

    An improvement is a change by more than ``min_delta`` in ``mode``'s direction. The best value
    and the count are in every checkpoint, so a resumed run goes on counting; stopping is
    ``trainer.request_stop`` (one checkpoint, ``"status": "stopped"``).

    Args:
        monitor: a key of the evaluation results, e.g. ``"val/loss"``.
        mode: ``"min"`` or ``"max"``: which direction is better.
        patience: evaluations without improvement before stopping.
        min_delta: the least change that counts as an improvement.
        state_key: the name its state is saved under (two EarlyStoppings need two names).

    Example:
        >>> Trainer(TrainerConfig(eval_every_n_steps=200),  # doctest: +SKIP
        ...         callbacks=[EarlyStopping("val/loss", patience=5)])
    """

    def __init__(self, monitor: str, mode: str = "min", patience: int = 3,
                 min_delta: float = 0.0, state_key: str = "EarlyStopping") -> None:
        if mode not in ("min", "max"):
            raise TrainkitError(f"EarlyStopping mode={mode!r}: use 'min' or 'max'")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise TrainkitError(f"EarlyStopping patience must be an integer >= 1, got "
                                f"{patience!r}")
        if not min_delta >= 0:
            raise TrainkitError(f"EarlyStopping min_delta must be >= 0, got {min_delta!r}")
        self.monitor, self.mode, self.patience = monitor, mode, patience
        self.min_delta, self.state_key = float(min_delta), state_key
        self.best: float | None = None
        self.bad_evaluations = 0  # in a row, since the best

    def on_evaluation_end(self, trainer: Any, results: Mapping[str, float], step: int) -> None:
        if self.monitor not in results:
            raise TrainkitError(f"EarlyStopping monitor={self.monitor!r} is not a result of the "
                                f"evaluation; choose one of {', '.join(results)}")
        value = float(results[self.monitor])
        if self._improves(value):
            self.best, self.bad_evaluations = value, 0
            return
        self.bad_evaluations += 1
        if self.bad_evaluations >= self.patience:
            trainer.request_stop(f"early stopping: {self.monitor} did not improve on "
                                 f"{self.best:.6g} for {self.bad_evaluations} evaluations")

    def _improves(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evaluations": self.bad_evaluations}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best = state["best"]
        self.bad_evaluations = int(state["bad_evaluations"])
