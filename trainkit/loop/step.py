"""One optimizer step over an accumulation window: weighting, no_sync, clipping, skipped steps."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from trainkit.core.device import move_to_device
from trainkit.core.errors import TrainkitError
from trainkit.core.tree import tensors
from trainkit.distributed.ddp import sync_gradients
from trainkit.loop.precision import Precision
from trainkit.observe.metrics import DeviceMean

Batch = Any
# (outputs, targets), or (outputs, targets, {name: scalar}) with scalars of the step's own
Forward = Callable[[nn.Module, Batch], tuple[Any, ...]]
Criterion = Callable[[Any, Any], torch.Tensor]
_FLAT = (tuple, list)  # the common batch, (inputs, targets), is checked without a walk
_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad
_TRAINKITS = ("loss", "lr")  # train/<name> tags trainkit logs itself


def default_forward(model: nn.Module, batch: Batch) -> tuple[Any, Any]:
    """``(inputs, targets)`` batches: run the model on the inputs, return outputs and targets."""
    inputs, targets = batch
    return model(inputs), targets


def batch_size(batch: Batch) -> int:
    """Samples in a batch: the leading size of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0].shape[0]  # the common (inputs, targets) batch, without a walk
    first = next(tensors(batch), None)
    if first is None:
        raise TypeError(
            f"cannot tell the number of samples in a batch of type {type(batch).__name__}")
    return first.shape[0]


def steps_per_epoch(batches: int, accumulate: int) -> int:
    """Optimizer steps over ``batches`` batches in windows of ``accumulate``: ceil(batches / k),
    a short last window being a step too (see :func:`windows`)."""
    return -(-batches // accumulate)


def windows(batches: Iterable[Batch], k: int) -> Iterator[Sequence[Batch]]:
    """Group batches into accumulation windows of ``k``; the last one may be shorter."""
    window: list[Batch] = []
    for batch in batches:
        window.append(batch)
        if len(window) == k:
            yield window
            window = []
    if window:
        yield window


class StepResult(NamedTuple):
    """What one optimizer step did, read by name (the loop, the NaN/inf guard, the meter)."""

    loss: torch.Tensor  # the window's mean loss, detached, on the device (reading it syncs)
    grad_norm: torch.Tensor | None  # total norm before clipping; None without norm clipping
    stepped: bool  # False when the step was skipped (fp16 overflow or a non-finite loss)
    samples: int
    finite: bool = True  # False when the loss was NaN or inf (checked only when asked)
    value: float | None = None  # the loss as a number, when the check read it
    # guard_finite: whether the loss was finite (all ranks agreed), on the device and unread
    finite_flag: torch.Tensor | None = None

    @property
    def logged_loss(self) -> torch.Tensor | float | None:
        """The loss for the meter: the number when the check read it (no second sync), None
        when it was NaN/inf."""
        if not self.finite:
            return None
        return self.loss if self.value is None else self.value

    @property
    def logged_grad_norm(self) -> torch.Tensor | None:
        """The norm for the meter; None for a skipped step (an fp16 overflow's norm is inf)."""
        return self.grad_norm if self.stepped else None


def train_window(
    model: nn.Module,
    window: Sequence[Batch],
    *,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    criterion: Criterion,
    forward: Forward,
    device: torch.device,
    clip_val: float | None = None,
    clip_algorithm: str = "norm",
    check_finite: bool = False,
    guard_finite: bool = False,
    agree: Callable[[Any], Any] | None = None,
) -> StepResult:
    """Forward/backward every micro-batch of ``window``, then one (possibly skipped) step.

    Each micro-batch's loss is weighted by its share of the window's samples: k batches of b give
    the gradient of one batch of k*b, and a short last window the mean over what it has.
    ``check_finite`` reads the loss on the host (a sync on a GPU) and skips a NaN/inf step
    (``finite=False``); ``guard_finite`` checks on the device instead: a bad window's gradients
    are zeroed (or a fused optimizer skips on the flag) and ``finite_flag`` says which, unread.
    Under DDP ``agree`` turns this rank's verdict into "any rank's" (a
    :class:`~trainkit.distributed.group.StepVote`), so all ranks skip together.
    """
    return WindowStep(model, optimizer=optimizer, precision=precision, criterion=criterion,
                      forward=forward, device=device, clip_val=clip_val,
                      clip_algorithm=clip_algorithm, agree=agree)(
        window, check_finite=check_finite, guard_finite=guard_finite)


class WindowStep:
    """:func:`train_window` with the arguments that hold for a whole fit bound once.

    What cannot change during a fit (autocast, loss scaling, clipping) is decided here, not per
    step. A ``forward`` may return a third item, ``{name: scalar}``: each is added, unread, to
    that name's :class:`~trainkit.observe.metrics.DeviceMean` in :attr:`scalars` (logged as
    ``train/<name>``).

    Example:
        >>> step = WindowStep(model, optimizer=optimizer, precision=Precision("32"),
        ...                   criterion=F.cross_entropy, forward=default_forward,
        ...                   device=torch.device("cpu"))  # doctest: +SKIP
        >>> for window in windows(loader, 4):  # doctest: +SKIP
        ...     result = step(window, check_finite=True)
    """

    def __init__(self, model: nn.Module, *, optimizer: torch.optim.Optimizer,
                 precision: Precision, criterion: Criterion, forward: Forward,
                 device: torch.device, clip_val: float | None = None,
                 clip_algorithm: str = "norm", agree: Callable[[Any], Any] | None = None,
                 scalars: dict[str, DeviceMean] | None = None) -> None:
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self.criterion, self.device = criterion, device
        self.clip_val, self.clip_algorithm, self.agree = clip_val, clip_algorithm, agree
        # the forward's own scalars, by name: a mean of each over the micro-batches since read
        self.scalars = scalars if scalars is not None else {}
        self.forward = forward
        self._forward = _own_scalars_to(self.scalars, forward)  # for the paths below the plain
        self._wrapped = False  # wrap_forward_once's wrapper waits for the next forward
        # fp32: no autocast to enter, no loss scaler to pass the backward and the step through
        self._plain = precision.dtype is None and precision.scaler is None
        # called after each micro-batch's backward, with whether it was the window's last
        # (micro_batch's DDP vote on out-of-memory); None: nothing to call
        self.after_backward: Callable[[bool], None] | None = None
        # fused kernels skip a NaN/inf step on a found_inf flag (not under GradScaler, whose own);
        # not SGD with momentum: a skipped first step leaves its buffers unset (_sgd_with_momentum)
        self._fused = (precision.scaler is None and is_fused(optimizer)
                       and not _sgd_with_momentum(optimizer))

    def __call__(self, window: Sequence[Batch], check_finite: bool = False,
                 guard_finite: bool = False) -> StepResult:
        """One optimizer step over ``window`` (see :func:`train_window` for the checks)."""
        if len(window) == 1:  # the common case: no weighting, no no_sync, nothing to add up
            loss, total = self._backward_one(window[0])
        else:
            loss, total = _accumulate(self.model, window, self.precision, self.criterion,
                                      self._forward, self.device, self.after_backward,
                                      self.scalars)
        if check_finite:
            return self._checked_on_host(loss, total)
        if guard_finite:
            return self._checked_on_device(loss, total)
        return self._update(loss, total)

    def _backward_one(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """Forward and backward of a window of one batch: its loss (detached) and samples."""
        if type(batch) in _FLAT and batch and type(batch[0]) is torch.Tensor:  # (x, y)
            total = batch[0].shape[0]
            for item in batch:  # already on the device (a CPU run's, a prefetcher's)?
                if not isinstance(item, torch.Tensor) or item.device != self.device:
                    batch = move_to_device(batch, self.device)
                    break
        else:
            total = batch_size(batch)
            batch = move_to_device(batch, self.device)
        if self._plain:
            result = self.forward(self.model, batch)
            # inline, not self._forward: the common path pays one len(), not a call
            outputs, targets = result if len(result) == 2 else self._forward.split(result)
            loss = self.criterion(outputs, targets)
            if type(loss) is tuple:  # (loss, {name: part})
                loss = split_loss(loss, self.scalars)
            loss.backward()
        else:
            loss = split_loss(_loss(self.model, batch, self.precision, self.criterion,
                                    self._forward), self.scalars)
            self.precision.backward(loss)
        # in place when allowed (a view cannot be): no new tensor a step
        loss = loss.detach_() if loss._base is None else loss.detach()
        if self.after_backward is not None:
            self.after_backward(True)
        return loss, total

    def _checked_on_host(self, loss: torch.Tensor, total: int) -> StepResult:
        """The step, skipped when the loss read on the host (a sync) is NaN/inf on any rank."""
        value = loss.item()  # host sync (see train_window)
        nonfinite = not math.isfinite(value)
        if self.agree is not None:
            nonfinite = self.agree(nonfinite)
        if nonfinite:
            drop_gradients(self.optimizer)
            return StepResult(loss, None, False, total, False, value)
        return self._update(loss, total, value)

    def _checked_on_device(self, loss: torch.Tensor, total: int) -> StepResult:
        """The step with a NaN/inf loss's gradients dropped on the device (no host read): a
        fused optimizer skips its update on the flag; others step on zeroed gradients."""
        flag = _drop_nonfinite_gradients(self.optimizer, loss, self.agree, self._fused)
        if not self._fused:
            return self._update(loss, total, finite_flag=flag)
        grad_norm = self._clip() if self.clip_val is not None else None
        _found_inf_step(self.optimizer, flag)
        drop_gradients(self.optimizer)
        return StepResult(loss, grad_norm, True, total, True, None, flag)

    def _update(self, loss: torch.Tensor, total: int, value: float | None = None,
                finite_flag: torch.Tensor | None = None) -> StepResult:
        """Clip, step the optimizer (through the loss scaler, which may skip), drop gradients."""
        grad_norm = self._clip() if self.clip_val is not None else None
        if self._plain:
            self.optimizer.step()
            stepped = True
        else:
            stepped = self.precision.step(self.optimizer)
        drop_gradients(self.optimizer)
        return StepResult(loss, grad_norm, stepped, total, True, value, finite_flag)

    def wrap_forward_once(self, wrap: Callable[[Forward], Forward]) -> None:
        """Run the next micro-batch's forward through ``wrap(forward)``, then the plain one.

        On every path (plain fp32, autocast, accumulation): each calls its forward through
        what this sets, and the first call puts the originals back. A second request before the
        first ran is ignored (no wrapper inside a wrapper).
        """
        if self._wrapped:
            return
        forward, split_forward = self.forward, self._forward
        wrapped, pending = wrap(forward), [True]

        # a flag, not `self.forward is once`: a closure naming itself is a reference cycle that
        # would keep this step (and its model) alive until the cyclic collector runs
        def once(model: nn.Module, batch: Batch) -> tuple[Any, ...]:
            if not pending[0]:  # a later micro-batch of the same window
                return forward(model, batch)
            pending[0] = False
            self.forward, self._forward, self._wrapped = forward, split_forward, False
            return wrapped(model, batch)

        self.forward, self._forward = once, _own_scalars_to(self.scalars, once)
        self._wrapped = True

    def _clip(self) -> torch.Tensor | None:
        """Clip the gradients by norm (returning the norm before clipping) or by value."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return clip_gradients(self.precision, params, self.optimizer, self.clip_val,
                              self.clip_algorithm)


def clip_gradients(precision: Precision, params: Sequence[torch.Tensor],
                   optimizer: torch.optim.Optimizer, clip_val: float,
                   algorithm: str = "norm") -> torch.Tensor | None:
    """Unscale ``optimizer``'s gradients, then clip ``params``' by norm (returning the total
    norm before clipping, a plain tensor also under FSDP) or by value (None)."""
    precision.unscale_(optimizer)  # clip true gradients, not loss-scaled ones
    if algorithm != "norm":
        nn.utils.clip_grad_value_(params, clip_val)
        return None
    grad_norm = nn.utils.clip_grad_norm_(params, clip_val)
    full_tensor = getattr(grad_norm, "full_tensor", None)  # FSDP: a DTensor
    if full_tensor is not None:  # the norm over all shards, as a plain tensor
        grad_norm = full_tensor()
    return grad_norm


def split_loss(result: Any, scalars: dict[str, DeviceMean]) -> torch.Tensor:
    """A criterion's ``(loss, {name: part})``: each part added, unread, to ``scalars`` (logged as
    ``train/<name>``); the loss returned. A plain loss is returned as it is."""
    if type(result) is not tuple:
        return result
    if len(result) != 2:
        raise TrainkitError(f"criterion returned {len(result)} items: return a loss or "
                            "(loss, {name: part})")
    loss, parts = result
    add_scalars(scalars, parts, what="criterion's part")
    return loss


def drop_gradients(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``: each parameter's ``.grad`` set to None.

    By hand, as torch's does it without its profiler range and dynamo wrapper: kept because
    ``python -m benchmarks.overhead`` shows it pays (benchmarks/README.md). An optimizer class
    with a ``zero_grad`` of its own has it called.
    """
    if type(optimizer).zero_grad is not _TORCH_ZERO_GRAD:
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


def _own_scalars_to(scalars: dict[str, DeviceMean], forward: Forward) -> Forward:
    """``forward`` returning ``(outputs, targets)`` always, its third item's scalars (if any)
    added to ``scalars``: one ``len`` a micro-batch when it returns none."""

    def split(result: Sequence[Any]) -> tuple[Any, Any]:
        if len(result) != 3:
            raise TrainkitError(f"forward returned {len(result)} items: return (outputs, "
                                "targets) or (outputs, targets, {name: scalar})")
        outputs, targets, own = result
        add_scalars(scalars, own)
        return outputs, targets

    def split_forward(model: nn.Module, batch: Batch) -> tuple[Any, Any]:
        result = forward(model, batch)
        return result if len(result) == 2 else split(result)

    split_forward.split = split  # type: ignore[attr-defined]
    return split_forward


def add_scalars(scalars: dict[str, DeviceMean] | None, own: Any,
                what: str = "forward's scalar") -> None:
    """Add a forward's ``{name: scalar}`` to the mean of each name, without a host read.

    Raises:
        TrainkitError: ``own`` is not a mapping, or a value is not a 0-d tensor or a number.
    """
    if not isinstance(own, Mapping):
        raise TrainkitError(f"forward's third item is a {type(own).__name__}, not a mapping: "
                            "return (outputs, targets, {'name': scalar_tensor})"
                            if what == "forward's scalar" else
                            f"{what}s are a {type(own).__name__}, not a mapping of name to "
                            "scalar")
    scalars = {} if scalars is None else scalars
    for name, value in own.items():
        if type(value) is not torch.Tensor or value.ndim:
            value = _scalar(name, value, what)
        elif value.dtype is not torch.float32:  # one dtype per mean: its values stack
            value = value.detach().float()
        else:
            value = value.detach()  # not the graph: a mean over the window would keep it alive
        mean = scalars.get(name)
        if mean is None:
            if name in _TRAINKITS:
                raise TrainkitError(f"{what} {name!r} would replace trainkit's own "
                                    f"train/{name}: give it another name")
            mean = scalars[name] = DeviceMean()
        mean.add(value)


def _scalar(name: Any, value: Any, what: str = "forward's scalar") -> float | torch.Tensor:
    """A number as a float, a 0-d tensor (of a subclass) as float32; else a one-line error."""
    if isinstance(value, torch.Tensor):
        if value.ndim:
            raise TrainkitError(f"{what} {name!r} has shape {tuple(value.shape)}: "
                                "return a 0-d tensor (e.g. its .mean()) or a number")
        return value.detach().float()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TrainkitError(f"{what} {name!r} is a {type(value).__name__}: return a 0-d "
                        "tensor or a number")


def _loss(model: nn.Module, batch: Batch, precision: Precision, criterion: Criterion,
          forward: Forward) -> torch.Tensor:
    """One micro-batch's forward pass and loss, under autocast when the precision has one."""
    if precision.dtype is None:  # fp32: no context to enter (this runs every micro-step)
        outputs, targets = forward(model, batch)
        return criterion(outputs, targets)
    with precision.autocast():
        outputs, targets = forward(model, batch)
        return criterion(outputs, targets)


def _accumulate(model: nn.Module, window: Sequence[Batch], precision: Precision,
                criterion: Criterion, forward: Forward, device: torch.device,
                after_backward: Callable[[bool], None] | None = None,
                scalars: dict[str, DeviceMean] | None = None) -> tuple[torch.Tensor, int]:
    """Forward/backward each micro-batch of a window of several, each loss weighted by its share
    of the samples; returns the window's mean loss (detached) and its sample count."""
    sizes = [batch_size(b) for b in window]
    total = sum(sizes)
    last = len(window) - 1
    losses = []
    for i, batch in enumerate(window):
        batch = move_to_device(batch, device)
        # Only the last micro-batch's backward all-reduces gradients under DDP.
        with contextlib.nullcontext() if i == last else sync_gradients(model, sync=False):
            loss = _loss(model, batch, precision, criterion, forward)
            if type(loss) is tuple:  # (loss, {name: part})
                loss = split_loss(loss, {} if scalars is None else scalars)
            loss = loss * (sizes[i] / total)
            precision.backward(loss)
        if after_backward is not None:
            after_backward(i == last)
        losses.append(loss.detach_())  # the product is no view: detached in place
    # Weighted micro-batch losses add up to the window's mean.
    return torch.stack(losses).sum(), total


def _drop_nonfinite_gradients(optimizer: torch.optim.Optimizer, loss: torch.Tensor,
                              agree: Callable[[Any], Any] | None,
                              fused: bool = False) -> torch.Tensor:
    """On a NaN/inf ``loss``, on the device (no host read, no sync): a ``fused`` optimizer gets
    the flag as ``found_inf`` and skips its update inside its kernel (as under GradScaler; see
    :func:`_found_inf_step`); otherwise every gradient is set to zero, in two ``torch._foreach_*``
    kernels over all gradients rather than one masked fill per parameter."""
    finite = torch.isfinite(loss)
    if agree is not None:  # any rank's bad loss drops every rank's step (a device all-reduce)
        finite = agree(finite.logical_not()).logical_not()
    if fused:  # the step takes the flag (_found_inf_step)
        return finite
    keep = finite.to(loss.dtype if loss.is_floating_point() else torch.float32)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                by_kind.setdefault((param.grad.device, param.grad.dtype), []).append(param.grad)
    for (device, dtype), grads in by_kind.items():
        scale = keep.to(device=device, dtype=dtype)
        # g ** 1 == g and g ** 0 == 1 even for NaN/inf, then * 1 or * 0: g, or 0 on a bad loss
        # (g * 0 alone would leave NaN * 0 = NaN in the gradients)
        torch._foreach_pow_(grads, [scale] * len(grads))
        torch._foreach_mul_(grads, scale)
    return finite


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter group runs torch's fused kernel (``Adam(fused=True)``, ...): one
    that takes a ``found_inf`` flag and skips its update on the device when it is set."""
    return bool(optimizer.param_groups) and all(
        group.get("fused") for group in optimizer.param_groups)


def _sgd_with_momentum(optimizer: torch.optim.Optimizer) -> bool:
    """SGD with momentum: torch's fused kernel creates its momentum buffers (``empty_like``)
    before it skips a step on ``found_inf``, so a skipped first step would leave them
    uninitialised. Zeroed gradients instead make them zeros: the next step is a first one's."""
    return isinstance(optimizer, torch.optim.SGD) and any(
        group.get("momentum") for group in optimizer.param_groups)


def _found_inf_step(optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
    """``optimizer.step()`` with ``found_inf`` (not ``finite``) set for it, removed after
    (GradScaler hands fused optimizers its overflow flag the same way)."""
    optimizer.found_inf = finite.logical_not().float()  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]
