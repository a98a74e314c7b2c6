"""One optimizer step over an accumulation window: weighting, no_sync, clipping, skipped steps.

Written once, for every step: a step function over a :class:`StepContext` (``Trainer.fit(...,
step=fn)``, several models and optimizers), run by :class:`ContextStep`; the built-in step
(forward, criterion, one optimizer) is such a function (:class:`WindowStep`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
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


def targets_counter(fn: Any) -> Callable[[Batch], torch.Tensor] | None:
    """The ``count_targets(batch)`` a forward or step function declares (through a
    ``functools.partial`` too): the valid targets of a batch, as a 0-d tensor. None: it declares
    none, and the window's loss is weighted by samples."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "count_targets", None)


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


class StepContext:
    """What a step function is given: the models, optimizers and schedulers by name, and the
    step's guarantees as methods (``Trainer.fit(..., step=fn)``; the built-in step is one such
    function, :class:`WindowStep`).

    Attributes:
        models: the models as the step calls them (DDP-wrapped, compiled), by name.
        optimizers: the optimizers, by name.
        schedulers: the LR schedulers, by the name of the optimizer each drives.
        device: where batches and models are.
        precision: the run's :class:`~trainkit.loop.precision.Precision` (the step function
            already runs inside its autocast).
        micro_batch: this call's index in the accumulation window (0 without accumulation).
        last: whether this is the window's last micro-batch (the one the optimizers step at).
        after_backward: called after each backward with :attr:`last` (micro-batching's vote).

    Token-normalised loss: a step function (or the built-in step's ``forward``, as
    :func:`trainkit.models.hf.hf_forward` does) that declares ``count_targets(batch) -> 0-d
    tensor`` (its valid targets, e.g. the labels that are not -100) hands :meth:`optimize` the
    SUM of its per-target losses over the micro-batch. The window's valid targets are counted,
    over every micro-batch and (a device all-reduce, no host read) every rank, before the first
    backward; each micro-batch's sum is scaled by ``world_size / count``: the gradient is that of
    the window's summed loss over its global count, whatever the accumulation and rank split
    (:attr:`count`: this micro-batch's own count). Without it, losses are weighted by samples.

        >>> def lm_step(ctx, batch):
        ...     logits = ctx.models["model"](batch["input_ids"])
        ...     ctx.optimize("model", F.cross_entropy(logits.flatten(0, 1),
        ...                  batch["labels"].flatten(), reduction="sum"))
        >>> lm_step.count_targets = lambda batch: (batch["labels"] != -100).sum()

    Example:
        >>> def gan_step(ctx, batch):
        ...     real = batch[0]
        ...     fake = ctx.models["g"](torch.randn(len(real), 8, device=ctx.device))
        ...     ctx.optimize("d", d_loss(ctx.models["d"], real, fake.detach()))
        ...     ctx.optimize("g", g_loss(ctx.models["d"], fake), frozen=["d"])
        >>> trainer.fit({"g": G, "d": D}, {"g": opt_g, "d": opt_d}, loader,
        ...             step=gan_step)  # doctest: +SKIP
    """

    def __init__(self, models: Mapping[str, nn.Module], optimizers: Mapping[str, Any], *,
                 precision: Precision, device: torch.device,
                 schedulers: Mapping[str, Any] | None = None, clip_val: float | None = None,
                 clip_algorithm: str = "norm", agree: Callable[[Any], Any] | None = None,
                 scalars: dict[str, DeviceMean] | None = None,
                 global_step: Callable[[], int] | None = None) -> None:
        self.models = dict(models)
        self.optimizers = dict(optimizers)
        self.schedulers = {k: v for k, v in (schedulers or {}).items() if v is not None}
        unknown = sorted(set(self.schedulers) - set(self.optimizers))
        if unknown:
            raise TrainkitError(f"schedulers {unknown} name no optimizer: name each by its "
                                f"optimizer ({', '.join(self.optimizers)})")
        self.precision, self.device = precision, device
        self.clip_val, self.clip_algorithm, self.agree = clip_val, clip_algorithm, agree
        # ctx.log's scalars (and each optimizer's loss): a mean over the log window, unread
        self.scalars = scalars if scalars is not None else {}
        self._global_step = global_step or (lambda: 0)
        self.after_backward: Callable[[bool], None] | None = None
        self.micro_batch, self.last, self._share = 0, True, 1.0
        # a counted window (count_targets): each micro-batch's count, the count's all-reduce
        # (a pending work or None) and world_size / the global count, once it is known
        self._counts: list[torch.Tensor] | None = None
        self._pending: Any = None
        self._scale: torch.Tensor | None = None
        self._total: torch.Tensor | None = None  # the window's count (summed over the ranks)
        self._world = 1
        # fp32: no autocast to enter, no loss scaler to pass the backward and the step through
        self._plain = precision.dtype is None and precision.scaler is None
        # fused kernels skip a NaN/inf step on a found_inf flag (not under GradScaler, whose
        # own); not SGD with momentum: a skipped first step leaves its buffers unset
        self._fused = {name: precision.scaler is None and is_fused(opt)
                       and not _sgd_with_momentum(opt) for name, opt in self.optimizers.items()}
        self._params = {name: [p for g in opt.param_groups for p in g["params"]]
                        for name, opt in self.optimizers.items()}
        self._named_loss = len(self.optimizers) > 1  # each optimizer's loss as train/loss_<name>
        self._begin_window(False, False)

    @property
    def global_step(self) -> int:
        """The optimizer step being taken (1 for the first)."""
        return self._global_step() + 1

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The step's autocast (already entered around the step function: for code of your
        own that runs outside it)."""
        return self.precision.autocast()

    @property
    def count(self) -> torch.Tensor | None:
        """This micro-batch's valid targets (a 0-d tensor on the device) when the window is
        counted (the step declares ``count_targets``), else None."""
        return None if self._counts is None else self._counts[self.micro_batch]

    def log(self, **scalars: torch.Tensor | float) -> None:
        """Log each scalar as ``train/<name>``, averaged over the log window on the device (no
        host read)."""
        add_scalars(self.scalars, scalars, what="ctx.log's scalar")

    def optimize(self, name: str, loss: Any, frozen: Iterable[str] = ()) -> None:
        """Backward ``loss`` for optimizer ``name``; at the window's last micro-batch, step it.

        The loss is weighted by the micro-batch's share of the window's samples (so k micro-
        batches of b give the gradient of one batch of k*b) and scaled under ``16-mixed``; in a
        counted window (the step declares ``count_targets``, see the class) ``loss`` is the sum
        over the micro-batch's valid targets, divided by the window's global count. At
        the last micro-batch: unscale and clip, the NaN/inf guard (a NaN/inf loss skips this
        optimizer's step only), ``optimizer.step()`` through the loss scaler, ``zero_grad`` and
        its scheduler. ``frozen``: models whose gradients this backward leaves as they were
        (their ``.grad`` is set aside around it): a GAN's generator step through the
        discriminator. ``loss`` may be a criterion's ``(loss, {name: part})``. Each optimizer is
        optimized at most once per micro-batch.

        Raises:
            TrainkitError: an unknown name, or a second call for one optimizer in a micro-batch.
        """
        if name in self._called or name not in self.optimizers:
            self._refuse(name)
        self._called.add(name)
        if type(loss) is tuple:  # a criterion's (loss, {name: part})
            loss = split_loss(loss, self.scalars)
        if self._counts is not None:
            loss = loss * self._count_scale()
        elif self._share != 1.0:
            loss = loss * self._share
        if self._plain:
            self._backward(name, loss, frozen)
            return
        if self.precision.dtype is not None:
            # the casts autocast cached for the forward: the graph holds what backward needs;
            # the cache would keep the rest alive through the backward and the step
            torch.clear_autocast_cache()
        with _no_autocast(self.precision):  # backward and step outside autocast (torch's advice)
            self._backward(name, loss, frozen)

    def _backward(self, name: str, loss: torch.Tensor, frozen: Iterable[str]) -> None:
        """The weighted loss's backward (frozen models' gradients set aside), then the step at
        the window's last micro-batch."""
        aside = self._set_aside(frozen) if frozen else ()
        if self._plain:
            loss.backward()
        else:
            self.precision.backward(loss)
        for param, grad in aside:
            param.grad = grad
        if self.after_backward is not None:
            self.after_backward(self.last)
        # in place when allowed (a view cannot be): no new tensor a step
        self._losses.setdefault(name, []).append(
            loss.detach_() if loss._base is None else loss.detach())
        if self.last:
            self._step(name)

    # -- the engine's side (ContextStep) -------------------------------------------------------

    def _count_window(self, counts: list[torch.Tensor]) -> None:
        """The window's valid targets per micro-batch: their sum over the ranks is started
        (asynchronously, on the device) and awaited at the first backward."""
        total = torch.stack(counts).sum() if len(counts) > 1 else counts[0].clone()
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        # DDP and FSDP average gradients over the ranks: world / global count undoes it
        self._counts, self._world, self._scale, self._total = counts, world, None, total
        self._pending = dist.all_reduce(total, async_op=True) if world > 1 else None

    def _count_scale(self) -> torch.Tensor:
        """``world_size / global count`` (a window without valid targets: ``world_size``)."""
        if self._scale is None:
            if self._pending is not None:  # NCCL: the stream waits, not the host
                self._pending.wait()
                self._pending = None
            assert self._total is not None
            self._scale = self._world / self._total.clamp_min(1).to(torch.float32)
        return self._scale

    def _refuse(self, name: str) -> None:
        if name not in self.optimizers:
            raise TrainkitError(f"ctx.optimize({name!r}): no optimizer of that name (the fit "
                                f"has {', '.join(self.optimizers)})")
        raise TrainkitError(f"ctx.optimize({name!r}) was called twice in one micro-batch: each "
                            "optimizer steps once per window (add the losses)")

    def _begin_window(self, check_finite: bool, guard_finite: bool) -> None:
        """A new window, at its first micro-batch (of one, until told otherwise)."""
        self._check_finite, self._guard_finite = check_finite, guard_finite
        self._losses: dict[str, list[torch.Tensor]] = {}
        # per optimizer: (finite, stepped, value, grad_norm, finite_flag, window loss)
        self._results: dict[str, tuple[Any, ...]] = {}
        self._called: set[str] = set()
        self._scaled = False  # an optimizer stepped through the loss scaler in this window
        self.micro_batch, self.last, self._share = 0, True, 1.0
        self._counts = self._pending = self._scale = None

    def _begin_micro_batch(self, index: int, last: bool, share: float) -> None:
        self.micro_batch, self.last, self._share = index, last, share
        if index:
            self._called = set()

    def _set_aside(self, frozen: Iterable[str]) -> list[tuple[torch.Tensor, Any]]:
        """The frozen models' gradients, taken off their parameters until the backward ends."""
        if isinstance(frozen, str):
            frozen = [frozen]
        aside = []
        for model_name in frozen:
            model = self.models.get(model_name)
            if model is None:
                raise TrainkitError(f"frozen={model_name!r}: no model of that name (the fit "
                                    f"has {', '.join(self.models)})")
            for param in model.parameters():
                aside.append((param, param.grad))
                param.grad = None
        return aside

    def _step(self, name: str) -> None:
        """Optimizer ``name``'s step over the window's gradients, guarded as the loop asks:
        ``check_finite`` reads the loss on the host (a sync on a GPU) and skips a NaN/inf step;
        ``guard_finite`` checks on the device instead (a bad window's gradients zeroed, or a
        fused optimizer skips on the flag)."""
        optimizer, losses = self.optimizers[name], self._losses[name]
        # weighted micro-batch losses add up to the window's mean
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
        value = flag = None
        if self._check_finite:
            value = loss.item()  # host sync: the loop reads this step anyway (CPU: free)
            bad = not math.isfinite(value)
            if self.agree is not None:
                bad = self.agree(bad)
            if bad:
                drop_gradients(optimizer)
                self._results[name] = (False, False, value, None, None, loss)
                return
        elif self._guard_finite:
            flag = _drop_nonfinite_gradients(optimizer, loss, self.agree, self._fused[name])
        grad_norm = (clip_gradients(self.precision, self._params[name], optimizer,
                                    self.clip_val, self.clip_algorithm)
                     if self.clip_val is not None else None)
        if flag is not None and self._fused[name]:
            _found_inf_step(optimizer, flag)
            stepped = True
        elif self._plain:
            optimizer.step()
            stepped = True
        else:
            stepped = self.precision.step(optimizer, update=False)
            self._scaled = True
        drop_gradients(optimizer)
        if stepped and self.schedulers:
            scheduler = self.schedulers.get(name)
            if scheduler is not None:
                scheduler.step()
        self._results[name] = (True, stepped, value, grad_norm, flag, loss)

    def _end_window(self, total: int) -> StepResult:
        """The window's result for the loop: the losses added up, finite when all optimizers'
        were, stepped when one did; the loss scale updated once for the iteration."""
        if self._scaled:
            self.precision.update()
        elif self.precision.scaler is not None:
            self.precision.forget_unscaled()
        results = self._results
        if len(results) == 1 and not self._named_loss:  # one optimizer: its own result
            (finite, stepped, value, grad_norm, flag, loss), = results.values()
            return StepResult(loss, grad_norm, stepped, total, finite, value, flag)
        if not results:  # no optimizer stepped in this window (the step chose none)
            return StepResult(torch.zeros((), device=self.device), None, True, total)
        window = {name: r[5] for name, r in results.items()}
        if self._named_loss:
            add_scalars(self.scalars, {f"loss_{name}": loss for name, loss in window.items()})
        loss = torch.stack([v.float() for v in window.values()]).sum()
        values = [r[2] for r in results.values()]
        norms = [r[3] for r in results.values() if r[3] is not None]
        flags = [r[4] for r in results.values() if r[4] is not None]
        return StepResult(
            loss, norms[0] if len(norms) == 1 else (
                torch.stack([n.float() for n in norms]).norm() if norms else None),
            any(r[1] for r in results.values()), total, all(r[0] for r in results.values()),
            sum(values) if None not in values else None,  # type: ignore[arg-type]
            flags[0] if len(flags) == 1 else (torch.stack(flags).all() if flags else None))


def _no_autocast(precision: Precision) -> contextlib.AbstractContextManager[Any]:
    if precision.dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(precision.device.type, enabled=False)


class ContextStep:
    """The loop's step over a step function: calls it once per micro-batch of a window, with
    the :class:`StepContext`, inside the step's autocast (and DDP's ``no_sync`` but at the
    window's last micro-batch), the batch on the device; returns what the window did."""

    def __init__(self, step: Callable[[StepContext, Batch], Any], ctx: StepContext) -> None:
        self.fn, self.ctx = step, ctx
        self.precision, self.device = ctx.precision, ctx.device
        self.model = next(iter(ctx.models.values()))
        self.optimizer = next(iter(ctx.optimizers.values()))
        # the models DDP wraps: their gradients wait for the window's last micro-batch
        self._synced = [m for m in ctx.models.values() if hasattr(m, "no_sync")]
        # the step's count_targets: a window's loss over its valid targets (StepContext)
        self.count_targets = targets_counter(step)

    @property
    def after_backward(self) -> Callable[[bool], None] | None:
        return self.ctx.after_backward

    @after_backward.setter
    def after_backward(self, hook: Callable[[bool], None] | None) -> None:
        self.ctx.after_backward = hook

    def __call__(self, window: Sequence[Batch], check_finite: bool = False,
                 guard_finite: bool = False) -> StepResult:
        """One optimizer step over ``window`` (see :func:`train_window` for the checks)."""
        ctx = self.ctx
        ctx._begin_window(check_finite, guard_finite)
        if self.count_targets is not None:
            return self._counted(window)
        if len(window) == 1:  # the common case: no weighting, no no_sync
            batch = window[0]
            if type(batch) in _FLAT and batch and type(batch[0]) is torch.Tensor:  # (x, y)
                total = batch[0].shape[0]
                for item in batch:  # already on the device (a CPU run's, a prefetcher's)?
                    if not isinstance(item, torch.Tensor) or item.device != self.device:
                        batch = move_to_device(batch, self.device)
                        break
            else:
                total = batch_size(batch)
                batch = move_to_device(batch, self.device)
            if ctx._plain:
                self.fn(ctx, batch)
            else:
                with self.precision.autocast():
                    self.fn(ctx, batch)
            return ctx._end_window(total)
        sizes = [batch_size(b) for b in window]
        total = sum(sizes)
        self._micro_batches(window, [size / total for size in sizes])
        return ctx._end_window(total)

    def _counted(self, window: Sequence[Batch]) -> StepResult:
        """A window whose loss is over its valid targets: all its batches on the device and
        counted before the first backward (the count summed over the ranks meanwhile)."""
        count = self.count_targets
        assert count is not None
        window = [move_to_device(batch, self.device) for batch in window]
        self.ctx._count_window([count(batch).to(self.device) for batch in window])
        self._micro_batches(window, [1.0] * len(window))
        return self.ctx._end_window(sum(batch_size(b) for b in window))

    def _micro_batches(self, window: Sequence[Batch], shares: Sequence[float]) -> None:
        """Each micro-batch through the step function with its loss share; under DDP only the
        last one's backward all-reduces."""
        ctx, last = self.ctx, len(window) - 1
        for i, batch in enumerate(window):
            batch = move_to_device(batch, self.device)
            ctx._begin_micro_batch(i, i == last, shares[i])
            with contextlib.ExitStack() as stack:
                if i != last:
                    for model in self._synced:
                        stack.enter_context(sync_gradients(model, sync=False))
                stack.enter_context(self.precision.autocast())
                self.fn(ctx, batch)

    def wrap_forward_once(self, wrap: Callable[[Forward], Forward]) -> None:
        """The advice's sampling of one forward: not for a step function (nothing to wrap)."""


class WindowStep(ContextStep):
    """:func:`train_window` with the arguments that hold for a whole fit bound once: the
    built-in step (``forward``, ``criterion``, one optimizer) as a step function over a
    :class:`StepContext`, so it has every guarantee a step of your own has, written once there.

    A ``forward`` may return a third item, ``{name: scalar}``, and a ``criterion``
    ``(loss, {name: part})``: each is added, unread, to that name's
    :class:`~trainkit.observe.metrics.DeviceMean` in :attr:`scalars` (logged as
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
        # the forward's own scalars, by name: a mean of each over the micro-batches since read
        self.scalars = scalars if scalars is not None else {}
        # the step function; not a method of this object, which holds it (no reference cycle)
        self._fn = _Supervised(model, criterion, forward, self.scalars)
        self._wrapped = False  # wrap_forward_once's wrapper waits for the next forward
        super().__init__(self._fn, StepContext(
            {"model": model}, {"model": optimizer}, precision=precision, device=device,
            clip_val=clip_val, clip_algorithm=clip_algorithm, agree=agree, scalars=self.scalars))
        self.model, self.optimizer = model, optimizer  # as given (ContextStep: the first-named)
        # a forward that declares count_targets: the loss over the window's valid targets
        self.count_targets = targets_counter(forward)

    @property
    def forward(self) -> Forward:
        """The forward the next micro-batch runs."""
        return self._fn.forward

    def wrap_forward_once(self, wrap: Callable[[Forward], Forward]) -> None:
        """Run the next micro-batch's forward through ``wrap(forward)``, then the plain one.

        On every path (plain fp32, autocast, accumulation): each calls its forward through
        what this sets, and the first call puts the originals back. A second request before the
        first ran is ignored (no wrapper inside a wrapper).
        """
        if self._wrapped:
            return
        fn = self._fn
        forward, split_forward = fn.forward, fn.split
        wrapped, pending = wrap(forward), [True]

        # a flag, not `fn.forward is once`: a closure naming itself is a reference cycle that
        # would keep this step (and its model) alive until the cyclic collector runs
        def once(model: nn.Module, batch: Batch) -> tuple[Any, ...]:
            if not pending[0]:  # a later micro-batch of the same window
                return forward(model, batch)
            pending[0] = False
            fn.forward, fn.split, self._wrapped = forward, split_forward, False
            return wrapped(model, batch)

        fn.forward, fn.split = once, _own_scalars_to(self.scalars, once).split
        self._wrapped = True


class _Supervised:
    """The built-in step as a step function: ``forward(model, batch)`` gives ``(outputs,
    targets)`` (or a third item of scalars), ``criterion`` the loss, the one optimizer steps."""

    __slots__ = ("criterion", "forward", "model", "split")

    def __init__(self, model: nn.Module, criterion: Criterion, forward: Forward,
                 scalars: dict[str, DeviceMean]) -> None:
        self.model, self.criterion, self.forward = model, criterion, forward
        self.split = _own_scalars_to(scalars, forward).split  # a third item's scalars

    def __call__(self, ctx: StepContext, batch: Batch) -> None:
        result = self.forward(self.model, batch)
        # inline, not a call: the common path pays one len()
        outputs, targets = result if len(result) == 2 else self.split(result)
        # each dropped once used: a forward's own scalars (their graph) not alive through the
        # loss, the outputs (an LM's logits) not through the backward
        del result
        loss = self.criterion(outputs, targets)
        del outputs, targets
        if ctx._counts is not None:  # a counted window: the criterion's mean back to a sum
            loss = times_count(loss, ctx._counts[ctx.micro_batch])
        ctx.optimize("model", loss)


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


def times_count(loss: Any, count: torch.Tensor) -> Any:
    """A criterion's mean over ``count`` valid targets as their sum (a ``(loss, parts)`` tuple:
    its loss; the parts stay means)."""
    if type(loss) is tuple and len(loss) == 2:
        return loss[0] * count, loss[1]
    return loss * count


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
