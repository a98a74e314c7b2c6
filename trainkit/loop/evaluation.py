"""Evaluation: the mean loss and each metric over a dataset, summed across ranks."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torchmetrics.aggregation import MeanMetric, SumMetric

from trainkit.core import rng
from trainkit.core.device import move_to_device
from trainkit.core.errors import TrainkitError
from trainkit.distributed import ddp, fsdp, group
from trainkit.loop.precision import Precision
from trainkit.loop.step import Criterion, Forward, _scalar, batch_size, targets_counter

log = logging.getLogger("trainkit")


# mixed into the run's seed for the evaluation's random stream (any constant apart from 0)
_EVAL_STREAM = 0x6576616C


@contextlib.contextmanager
def own_stream(seed: int | None, runtime: Any) -> Iterator[None]:
    """Evaluation on a random stream of its own: every generator (Python, NumPy, torch) seeded
    from ``seed`` and the rank for it, and put back as it was after, so that evaluating never
    moves the training stream (a DataLoader's iterator alone draws its seed from torch's).
    Each evaluation draws the same numbers: evaluations compare alike."""
    saved = rng.get_rng_state()
    rng.seed_rank(runtime.rank, rng.mix_seed(_EVAL_STREAM, seed or 0), device=runtime.device)
    try:
        yield
    finally:
        rng.set_rng_state(saved)


@torch.no_grad()
def evaluate_apart(seed: int, runtime: Any, model: nn.Module, data: Iterable[Any],
                   **options: Any) -> dict[str, float]:
    """:func:`evaluate` on the evaluation's own random stream (:func:`own_stream`)."""
    with own_stream(seed, runtime):
        return evaluate(model, data, **options)


def evaluate(model: nn.Module, data: Iterable[Any], *, precision: Precision,
             device: torch.device, criterion: Criterion | None,
             metrics: Mapping[str, Any] | None,
             forward: Forward, max_batches: int | None = None) -> dict[str, float]:
    """Mean loss and each metric over ``data`` (at most ``max_batches`` batches, when given) as
    ``{"val/loss": ..., "val/<name>": ...}``, in eval mode under ``no_grad``.

    A criterion's parts (``(loss, {name: part})``) and a forward's own scalars (a third item)
    are averaged over the samples as ``val/<name>``; ``criterion`` None computes no loss. A
    ``data`` with ``parts`` (a mixture's, ``{name: loader}``) adds each part's loss as
    ``val/loss/<name>`` (``max_batches`` bounds each part); ``val/loss`` is over all of them. A
    forward that declares ``count_targets`` (padded text's -100 labels) gets each loss as the
    mean over the valid targets (each batch's mean weighted by its count).

    The sample itself is the data layer's: trainkit's evaluation loaders built with the same
    bound serve ``max_batches`` batches spread evenly over the split
    (:func:`trainkit.data.loader.resumable.evaluation_sample`); any other loader gives its first
    ones.
    """
    # Not through DDP: it broadcasts buffers before every forward, a collective that ranks
    # with different numbers of val batches would not match. Rank 0's buffers (batch-norm
    # statistics drift per rank) make the result that of the checkpointed weights.
    model, metrics = ddp.unwrap(model), metrics or {}
    ddp.broadcast_buffers(model)
    was_training = model.training
    model.eval()
    for metric in metrics.values():
        metric.reset()
    # The loss is a metric like the others: torchmetrics sums it over the ranks in compute().
    count_targets = targets_counter(forward)
    loss = _Loss(device, count_targets)
    means: dict[str, MeanMetric] = {}  # parts and scalars by name
    # a mixture's evaluation (data.mix): each corpus apart, its loss as val/loss/<name> too
    parts = getattr(data, "parts", None)
    streams = list(parts.items()) if isinstance(parts, Mapping) else [(None, data)]
    apart: dict[str, _Loss] = {}  # each part's loss
    for name, stream in streams:
        part_loss = None
        if name is not None and criterion is not None:
            part_loss = apart[f"loss/{name}"] = _Loss(device, count_targets)
        _evaluate_stream(model, stream, precision=precision, device=device,
                         criterion=criterion, metrics=metrics, forward=forward,
                         max_batches=max_batches, losses=(loss, part_loss), means=means)
    # torchmetrics syncs its states across ranks in compute() when a process group is up
    results = {"val/loss": loss.compute()} if criterion is not None else {}
    results.update({f"val/{name}": m.compute() for name, m in apart.items()})
    results.update({f"val/{name}": float(m.compute()) for name, m in means.items()})
    results.update({f"val/{name}": float(m.compute()) for name, m in metrics.items()})
    model.train(was_training)
    return results


def _evaluate_stream(model: nn.Module, data: Iterable[Any], *, precision: Precision,
                     device: torch.device, criterion: Criterion | None,
                     metrics: Mapping[str, Any], forward: Forward, max_batches: int | None,
                     losses: tuple[_Loss, _Loss | None],
                     means: dict[str, MeanMetric]) -> None:
    """One loader's batches into the loss (and a part's own loss), the parts and the metrics."""
    # FSDP: each forward all-gathers weights, so every rank runs as many (agreed before any)
    extra = _missing_forwards(data, max_batches) if fsdp.is_sharded(model) else None
    batch = None
    for batch in data if max_batches is None else itertools.islice(data, max_batches):
        batch = move_to_device(batch, device)
        n = batch_size(batch)
        with precision.autocast():
            result = forward(model, batch)
            outputs, targets = result[0], result[1]
            if criterion is not None:
                value = criterion(outputs, targets)
                if type(value) is tuple:  # (loss, {name: part})
                    value, parts = value
                    _add_means(means, parts, n, device)
                for loss in losses:
                    if loss is not None:
                        loss.update(value, n, batch)
        if len(result) == 3:  # the forward's own scalars
            _add_means(means, result[2], n, device)
        for metric in metrics.values():
            metric.update(outputs, targets)
    if extra is not None:
        _match_forwards(model, extra, batch, precision, forward)


class _Loss:
    """A validation loss over samples: each batch's mean repeated ``n`` times (torchmetrics
    drops weights under ``nan_strategy="disable"``, and any other strategy reads every batch's
    NaN check on the host); with ``count_targets``, over targets: sum(mean * count) / sum(count).
    """

    def __init__(self, device: torch.device, count_targets: Any) -> None:
        self.count_targets = count_targets
        if count_targets is None:
            self.mean = MeanMetric(nan_strategy="disable").to(device)
        else:
            self.sum, self.count = (SumMetric(nan_strategy="disable").to(device)
                                    for _ in range(2))

    def update(self, value: torch.Tensor, n: int, batch: Any) -> None:
        value = value.detach().float()
        if self.count_targets is None:
            self.mean.update(value.expand(n))
        else:
            count = self.count_targets(batch).to(value.device)
            self.sum.update(value * count)
            self.count.update(count.float())

    def compute(self) -> float:
        if self.count_targets is None:
            return float(self.mean.compute())
        return float(self.sum.compute() / self.count.compute())


def _add_means(means: dict[str, MeanMetric], scalars: Any, n: int,
               device: torch.device) -> None:
    """Each ``{name: scalar}`` into its sample-weighted mean (no host read)."""
    if not isinstance(scalars, Mapping):
        raise TrainkitError(f"evaluation scalars are a {type(scalars).__name__}, not a mapping")
    for name, value in scalars.items():
        value = _scalar(name, value, "evaluation scalar")
        mean = means.get(name)
        if mean is None:
            mean = means[name] = MeanMetric(nan_strategy="disable").to(device)
        value = torch.as_tensor(value, dtype=torch.float32, device=device)
        mean.update(value.expand(n))


def _missing_forwards(data: Iterable[Any], max_batches: int | None) -> int:
    """How many batches fewer than the rank with the most this rank has (an uneven split)."""
    if not group.is_distributed():
        return 0
    mine = len(data)  # type: ignore[arg-type]
    if max_batches is not None:
        mine = min(mine, max_batches)
    counts = group.all_gather(mine)
    if min(counts) == 0 < max(counts):  # all ranks know: all stop, none waits for the others
        raise TrainkitError(f"FSDP evaluation: a rank has no validation batch while others have "
                            f"some ({counts} by rank); use fewer ranks or more validation data")
    return max(counts) - mine


def _match_forwards(model: nn.Module, extra: int, batch: Any, precision: Precision,
                    forward: Forward) -> None:
    """FSDP: a rank with fewer val batches runs its last one ``extra`` times more, uncounted,
    for the other ranks' all-gathers; then all reshard, so that no gathered copy outlives the
    weights it was made from (the EMA swaps them in place)."""
    for _ in range(extra):
        with precision.autocast():
            forward(model, batch)
    fsdp.reshard(model)


class LossWatch:
    """Says in one line, once per run, that validation loss shows the run diverging: not
    finite, or over ``factor`` times its first value (in this process). The usual cause is a
    learning rate too high for the model and data -- often another dataset's recipe, such as
    MNIST's one-cycle lr 0.01 on photos -- so the line names those, not a bug to hunt."""

    def __init__(self, factor: float = 1e3) -> None:
        self.factor = factor
        self.first: float | None = None
        self.said = False

    def check(self, results: Mapping[str, float], step: int, main: bool = True) -> str | None:
        """The line for an evaluation's ``results`` (logged: a warning on rank 0), or None."""
        loss = results.get("val/loss")
        if loss is None or self.said:
            return None
        if self.first is None and math.isfinite(loss):
            self.first = loss
        if math.isfinite(loss) and not loss > self.factor * abs(self.first or loss):
            return None
        self.said = True
        what = (f"val/loss is {loss}" if not math.isfinite(loss) else
                f"val/loss {loss:.4g} is over {self.factor:g}x its first value ({self.first:.4g})")
        line = (f"{what} at step {step}: the run is diverging, most likely a learning rate too "
                "high for this model and data (lower optim.lr) or another dataset's recipe "
                "(own images: start from +exp=folder)")
        (log.warning if main else log.info)(line)
        return line


class EvalSchedule:
    """Which steps evaluate: every ``eval_every_n_steps``, an epoch's last step when
    ``eval_every_n_epochs`` says so, and the run's last step. A function of the step, so a
    resumed run evaluates where the first would.

    Args:
        every_n_steps: evaluate at multiples of this step (None or 0: not by steps).
        every_n_epochs: evaluate at the end of every n-th epoch.
        total_steps: the run's last step (always evaluated).
        enabled: False when the run has no validation data: no step evaluates.
    """

    def __init__(self, every_n_steps: int | None, every_n_epochs: int, total_steps: int,
                 enabled: bool = True) -> None:
        self.every_n_steps, self.every_n_epochs = every_n_steps, every_n_epochs
        self.total_steps, self.enabled = total_steps, enabled
        self._epoch_end = self._next = 0

    def start_epoch(self, step: int, epoch: int, epoch_end: int) -> None:
        """An epoch (index ``epoch``, from 0) starts after step ``step`` and ends at step
        ``epoch_end``."""
        self._epoch_end = epoch_end if (epoch + 1) % self.every_n_epochs == 0 else 0
        self._next = self._after(step)

    def due(self, step: int) -> bool:
        """Whether step ``step`` evaluates (called after every step: one comparison)."""
        if step != self._next:
            return False
        self._next = self._after(step)
        return True

    def _after(self, step: int) -> int:
        """The first step after ``step`` that evaluates (0: none)."""
        if not self.enabled:
            return 0
        due = [self.total_steps]
        if self.every_n_steps:
            due.append((step // self.every_n_steps + 1) * self.every_n_steps)
        if self._epoch_end > step:
            due.append(self._epoch_end)
        return min(due)
