"""A step you write: several named models and optimizers, driven through one context.

``Trainer.fit({"g": G, "d": D}, {"g": opt_g, "d": opt_d}, data, step=gan_step)`` calls
``gan_step(ctx, batch)`` once per micro-batch (once per optimizer step without accumulation),
inside the step's autocast. ``ctx.optimize(name, loss)`` does for that optimizer what trainkit's
own step does: the loss weighted by the micro-batch's share of the window, backward (scaled under
``16-mixed``), and at the window's last micro-batch unscale + clip, the NaN/inf guard (no host
read where the loop does not read anyway), ``optimizer.step``, ``zero_grad`` and its scheduler.
The loss scale is updated once per iteration, after every optimizer stepped (torch's recipe for
several optimizers). See docs/research.md, "Your own step".
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainkit.core.device import move_to_device
from trainkit.core.errors import TrainkitError
from trainkit.distributed.ddp import sync_gradients
from trainkit.loop.precision import Precision
from trainkit.loop.step import (
    Batch,
    Criterion,
    Forward,
    StepResult,
    _drop_nonfinite_gradients,
    _found_inf_step,
    _sgd_with_momentum,
    add_scalars,
    batch_size,
    clip_gradients,
    drop_gradients,
    is_fused,
    split_loss,
)
from trainkit.observe.metrics import DeviceMean

StepFn = Callable[["StepContext", Batch], Any]


class StepContext:
    """What a step function is given: the models, optimizers and schedulers by name, and the
    step's guarantees as methods.

    Attributes:
        models: the models as the step calls them (DDP-wrapped, compiled), by name.
        optimizers: the optimizers, by name.
        schedulers: the LR schedulers, by the name of the optimizer each drives.
        device: where batches and models are.
        precision: the run's :class:`~trainkit.loop.precision.Precision` (the step function
            already runs inside its autocast).
        micro_batch: this call's index in the accumulation window (0 without accumulation).
        last: whether this is the window's last micro-batch (the one the optimizers step at).

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
        self.micro_batch, self.last = 0, True
        self._share = 1.0
        self._plain = precision.dtype is None and precision.scaler is None
        # fused kernels skip a NaN/inf step on a found_inf flag (see WindowStep)
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

    def log(self, **scalars: torch.Tensor | float) -> None:
        """Log each scalar as ``train/<name>``, averaged over the log window on the device (no
        host read); in an ``evaluate`` function, as ``val/<name>`` averaged over the split."""
        add_scalars(self.scalars, scalars, what="ctx.log's scalar")

    def optimize(self, name: str, loss: torch.Tensor, frozen: Iterable[str] = ()) -> None:
        """Backward ``loss`` for optimizer ``name``; at the window's last micro-batch, step it.

        The loss is weighted by the micro-batch's share of the window's samples (so k micro-
        batches of b give the gradient of one batch of k*b) and scaled under ``16-mixed``. At
        the last micro-batch: unscale and clip, the NaN/inf guard (a NaN/inf loss skips this
        optimizer's step only), ``optimizer.step()`` through the loss scaler, ``zero_grad`` and
        its scheduler. ``frozen``: models whose gradients this backward leaves as they were
        (their ``.grad`` is set aside around it): a GAN's generator step through the
        discriminator. Each optimizer is optimized at most once per micro-batch.

        Raises:
            TrainkitError: an unknown name, or a second call for one optimizer in a micro-batch.
        """
        if name not in self.optimizers:
            raise TrainkitError(f"ctx.optimize({name!r}): no optimizer of that name (the fit "
                                f"has {', '.join(self.optimizers)})")
        if name in self._called:
            raise TrainkitError(f"ctx.optimize({name!r}) was called twice in one micro-batch: "
                                "each optimizer steps once per window (add the losses)")
        self._called.add(name)
        if type(loss) is tuple:  # a criterion's (loss, {name: part})
            loss = split_loss(loss, self.scalars)
        if self._share != 1.0:
            loss = loss * self._share
        aside = self._set_aside(frozen)
        if self._plain:
            loss.backward()
        else:
            with _no_autocast(self.precision):  # backward outside autocast (torch's advice)
                self.precision.backward(loss)
        for param, grad in aside:
            param.grad = grad
        loss = loss.detach()
        window = self._losses.get(name)
        self._losses[name] = loss if window is None else window + loss
        if self.last:
            self._step(name)

    # -- the engine's side --------------------------------------------------------------------

    def _begin_window(self, check_finite: bool, guard_finite: bool) -> None:
        self._check_finite, self._guard_finite = check_finite, guard_finite
        self._losses: dict[str, torch.Tensor] = {}
        self._results: dict[str, tuple[bool, bool, float | None, Any, Any]] = {}
        self._called: set[str] = set()
        self._scaled = False  # an optimizer stepped through the loss scaler in this window

    def _begin_micro_batch(self, index: int, last: bool, share: float) -> None:
        self.micro_batch, self.last, self._share = index, last, share
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
        """Optimizer ``name``'s step over the window's gradients, guarded as the loop asks."""
        optimizer, loss = self.optimizers[name], self._losses[name]
        value, flag = None, None
        if self._check_finite:
            value = loss.item()  # host sync: the loop reads this step anyway (CPU: free)
            bad = not math.isfinite(value)
            if self.agree is not None:
                bad = self.agree(bad)
            if bad:
                drop_gradients(optimizer)
                self._results[name] = (False, False, value, None, None)
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
            self._scaled = self._scaled or self.precision.scaler is not None
        drop_gradients(optimizer)
        scheduler = self.schedulers.get(name)
        if stepped and scheduler is not None:
            scheduler.step()
        self._results[name] = (True, stepped, value, grad_norm, flag)

    def _end_window(self, total: int) -> StepResult:
        """The window's result for the loop: the losses added up, finite and stepped when all
        optimizers' were; the loss scale updated once."""
        if self._scaled:
            self.precision.update()
        elif self.precision.scaler is not None:
            self.precision._unscaled.clear()
        results = self._results
        if not results:  # no optimizer stepped in this window (the step chose none)
            zero = torch.zeros((), device=self.device)
            return StepResult(zero, None, True, total)
        if self._named_loss:
            add_scalars(self.scalars, {f"loss_{name}": loss for name, loss in
                                       self._losses.items()})
        losses = list(self._losses.values())
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
        finite = all(r[0] for r in results.values())
        stepped = any(r[1] for r in results.values())
        values = [r[2] for r in results.values()]
        value = sum(values) if all(v is not None for v in values) else None  # type: ignore[arg-type]
        norms = [r[3] for r in results.values() if r[3] is not None]
        grad_norm = norms[0] if len(norms) == 1 else (
            torch.stack([n.float() for n in norms]).norm() if norms else None)
        flags = [r[4] for r in results.values() if r[4] is not None]
        flag = flags[0] if len(flags) == 1 else (torch.stack(flags).all() if flags else None)
        return StepResult(loss, grad_norm, stepped, total, finite, value, flag)


def _no_autocast(precision: Precision) -> contextlib.AbstractContextManager[Any]:
    if precision.dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(precision.device.type, enabled=False)


class ContextStep:
    """The loop's step over a step function: calls it once per micro-batch of a window, with
    the :class:`StepContext`, inside the step's autocast (and DDP's ``no_sync`` but at the
    window's last micro-batch); returns what the window did as a
    :class:`~trainkit.loop.step.StepResult`, as :class:`~trainkit.loop.step.WindowStep` does."""

    def __init__(self, step: StepFn, ctx: StepContext) -> None:
        self.fn, self.ctx = step, ctx
        self.precision = ctx.precision
        self.model = next(iter(ctx.models.values()))
        self.optimizer = next(iter(ctx.optimizers.values()))
        # the models DDP wraps: their gradients wait for the window's last micro-batch
        self._synced = [m for m in ctx.models.values() if hasattr(m, "no_sync")]
        self.after_backward: Callable[[bool], None] | None = None  # micro_batch's; unused here

    def __call__(self, window: Sequence[Batch], check_finite: bool = False,
                 guard_finite: bool = False) -> StepResult:
        ctx, fn, device = self.ctx, self.fn, self.ctx.device
        ctx._begin_window(check_finite, guard_finite)
        sizes = [batch_size(b) for b in window]
        total = sum(sizes)
        last = len(window) - 1
        for i, batch in enumerate(window):
            batch = move_to_device(batch, device)
            ctx._begin_micro_batch(i, i == last, sizes[i] / total if last else 1.0)
            with contextlib.ExitStack() as stack:
                if i != last:  # only the last micro-batch's backward all-reduces under DDP
                    for model in self._synced:
                        stack.enter_context(sync_gradients(model, sync=False))
                stack.enter_context(self.precision.autocast())
                fn(ctx, batch)
        return ctx._end_window(total)

    def wrap_forward_once(self, wrap: Callable[[Forward], Forward]) -> None:
        """The advice's sampling of one forward: not for a step function (nothing to wrap)."""


def supervised_step(model: str, optimizer: str, forward: Forward,
                    criterion: Criterion) -> StepFn:
    """The built-in step as a step function: ``forward(model, batch)`` gives ``(outputs,
    targets)`` (optionally ``{name: scalar}`` too), ``criterion`` the loss (optionally
    ``(loss, {name: part})``), and optimizer ``optimizer`` steps on it."""

    def step(ctx: StepContext, batch: Batch) -> None:
        result = forward(ctx.models[model], batch)
        if len(result) == 3:
            add_scalars(ctx.scalars, result[2])
        ctx.optimize(optimizer, criterion(result[0], result[1]))

    return step


def trained_models(models: Mapping[str, nn.Module],
                   optimizers: Mapping[str, Any]) -> dict[str, bool]:
    """Whether each model has a parameter some optimizer holds (a model none holds is frozen
    for the fit: not wrapped by DDP, kept in eval mode)."""
    held = {id(p) for opt in optimizers.values() for g in opt.param_groups for p in g["params"]}
    return {name: any(id(p) in held for p in model.parameters())
            for name, model in models.items()}


class Named:
    """Several objects by name as one checkpoint part: ``state_dict`` is ``{name: state}``."""

    def __init__(self, parts: Mapping[str, Any]) -> None:
        self.parts = dict(parts)

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = sorted(set(self.parts) - set(state))
        if missing:
            raise TrainkitError(f"the checkpoint has no state for {missing} (it has "
                                f"{sorted(state)}): resume with the same names")
        for name, part in self.parts.items():
            part.load_state_dict(state[name])


class EvalContext:
    """What an ``evaluate(ctx, batch)`` function is given: the models (in eval mode, under
    ``no_grad``, not DDP-wrapped), the device, the precision; ``ctx.log`` adds ``val/<name>``
    scalars, averaged over the split."""

    def __init__(self, models: Mapping[str, nn.Module], precision: Precision,
                 device: torch.device) -> None:
        self.models, self.precision, self.device = dict(models), precision, device
        self.scalars: dict[str, Any] = {}

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self.precision.autocast()

    def log(self, **scalars: torch.Tensor | float) -> None:
        """Log each scalar as ``val/<name>``, averaged over the evaluated samples."""
        self.scalars.update(scalars)


class NamedFit:
    """A fit's named models, optimizers and schedulers with its step and evaluate functions
    (``Trainer.fit``'s dict form, or any fit given ``step=``)."""

    def __init__(self, models: dict[str, nn.Module], optimizers: dict[str, Any],
                 step: StepFn, schedulers: dict[str, Any],
                 evaluate: Callable[[Any, Batch], Any] | None) -> None:
        self.models, self.optimizers, self.step = models, optimizers, step
        self.schedulers, self.evaluate = schedulers, evaluate
        self.trained = {name: True for name in models}  # set as the models are placed
        self.step_models = models  # as the step calls them (compiled when asked)

    @classmethod
    def of(cls, model: Any, optimizer: Any, criterion: Criterion | None, step: StepFn | None,
           forward: Forward, schedulers: Any, scheduler: Any,
           evaluate: Any) -> tuple[NamedFit | None, Criterion | None]:
        """From ``fit``'s arguments: None for today's form (one model, one optimizer, no
        ``step``), and the criterion (default cross-entropy; with ``step=``, none unless given:
        it then only gives ``val/loss``). A lone model or optimizer is named ``"model"`` (so
        ``ctx.optimize("model", loss)``)."""
        if step is None and not isinstance(model, Mapping) and not isinstance(optimizer,
                                                                                Mapping):
            return None, criterion or F.cross_entropy
        models = dict(model) if isinstance(model, Mapping) else {"model": model}
        optimizers = dict(optimizer) if isinstance(optimizer, Mapping) else {"model": optimizer}
        if not models or not optimizers:
            raise TrainkitError("fit needs at least one model and one optimizer")
        for name, module in models.items():
            if not isinstance(module, nn.Module):
                raise TrainkitError(f"model {name!r} is a {type(module).__name__}, not a "
                                    "torch.nn.Module")
        schedulers = dict(schedulers or {})
        if scheduler is not None:
            if len(optimizers) > 1:
                raise TrainkitError("scheduler= with several optimizers: pass schedulers="
                                    "{optimizer_name: scheduler}")
            schedulers.setdefault(next(iter(optimizers)), scheduler)
        if step is None:
            if len(models) > 1 or len(optimizers) > 1:
                raise TrainkitError("several models or optimizers need step=fn(ctx, batch) to "
                                    "say how they train (docs/research.md, 'Your own step')")
            criterion = criterion or F.cross_entropy
            step = supervised_step(next(iter(models)), next(iter(optimizers)), forward,
                                   criterion)
        return cls(models, optimizers, step, schedulers, evaluate), criterion

    @property
    def first_model(self) -> nn.Module:
        return next(iter(self.models.values()))

    @property
    def first_optimizer(self) -> Any:
        return next(iter(self.optimizers.values()))

    def place(self, prepare: Callable[[nn.Module, Any], nn.Module], config: Any,
              runtime: Any) -> nn.Module:
        """Each model placed as fit trains it: a trained one by ``prepare`` (the Trainer's
        ``prepare_model``: DDP wraps it once), one no optimizer holds (a teacher) moved to the
        device and frozen (``requires_grad_(False)``: nothing to average, step or keep
        gradients for); the first-named returned.

        Raises:
            TrainkitError: several models under FSDP, or ``micro_batch_size=auto`` with
                several models or optimizers.
        """
        from trainkit.distributed import fsdp

        several = len(self.models) > 1 or len(self.optimizers) > 1
        if len(self.models) > 1 and fsdp.resolve_strategy(config.strategy,
                                                           runtime.world_size) == "fsdp":
            raise TrainkitError("trainer.strategy=fsdp shards one model: a fit of several "
                                "models (step=) runs under ddp or in one process")
        if several and config.micro_batch_size == "auto":
            raise TrainkitError("trainer.micro_batch_size=auto retries one model's step: with "
                                "several models or optimizers set a number of samples")
        self.trained = trained_models(self.models, self.optimizers)
        # in reverse: the first-named trained model is prepared last (its FLOPs are metered)
        for name in reversed(list(self.models)):
            model = self.models[name]
            self.models[name] = (prepare(model, self.first_optimizer) if self.trained[name]
                                 else model.to(runtime.device).requires_grad_(False))
        self.step_models = dict(self.models)
        return self.first_model

    def compile(self, mode: bool | str) -> nn.Module:
        """The step's models compiled as ``trainer.compile`` says (each trained one; none when
        off); the first-named as the step calls it."""
        from trainkit.distributed import strategy

        if mode:
            self.step_models = {name: strategy.compiled(model, mode) if self.trained[name]
                                else model for name, model in self.models.items()}
        return next(iter(self.step_models.values()))

    def context_step(self, precision: Precision, config: Any, agree: Any,
                     scalars: dict[str, DeviceMean], state: Any) -> ContextStep:
        """The loop's step: the step function over a :class:`StepContext` of this fit."""
        ctx = StepContext(self.step_models, self.optimizers, precision=precision,
                          device=precision.device, schedulers=self.schedulers,
                          clip_val=config.gradient_clip_val,
                          clip_algorithm=config.gradient_clip_algorithm, agree=agree,
                          scalars=scalars, global_step=lambda: state.global_step)
        return ContextStep(self.step, ctx)

    def rates(self) -> dict[str, float]:
        """Each optimizer's learning rate as ``train/lr_<name>`` (several optimizers)."""
        if len(self.optimizers) < 2:
            return {}
        return {f"train/lr_{name}": opt.param_groups[0]["lr"]
                for name, opt in self.optimizers.items()}

    def register(self, checkpointer: Any) -> None:
        """Several models or optimizers: each by name in every checkpoint (``models``,
        ``optimizers``, ``schedulers``), beside ``model``/``optimizer`` (the first-named's);
        one of each: the checkpoint of a plain fit, the scheduler as ``scheduler``."""
        from trainkit.distributed import ddp

        if len(self.models) == 1 and len(self.optimizers) == 1:
            checkpointer.parts["scheduler"] = next(iter(self.schedulers.values()), None)
            return
        checkpointer.parts["models"] = Named({name: ddp.unwrap(m)
                                              for name, m in self.models.items()})
        checkpointer.parts["optimizers"] = Named(self.optimizers)
        checkpointer.parts["schedulers"] = Named(self.schedulers)

    def eval_forward(self, precision: Precision) -> Forward:
        """The evaluation's ``forward(model, batch)``: ``evaluate(ctx, batch)`` over an
        :class:`EvalContext` (its ``ctx.log`` scalars as a third item), else the first model's
        default forward."""
        from trainkit.distributed import ddp
        from trainkit.loop.step import default_forward

        if self.evaluate is None:
            return default_forward
        ctx = EvalContext({n: ddp.unwrap(m) for n, m in self.models.items()}, precision,
                          precision.device)
        evaluate = self.evaluate

        def forward(model: nn.Module, batch: Batch) -> tuple[Any, ...]:
            ctx.scalars = {}
            result = evaluate(ctx, batch)
            if not isinstance(result, tuple) or len(result) not in (2, 3):
                raise TrainkitError("evaluate(ctx, batch) must return (outputs, targets)")
            if ctx.scalars:
                own = dict(result[2]) if len(result) == 3 else {}
                return result[0], result[1], {**own, **ctx.scalars}
            return result

        return forward

    @contextlib.contextmanager
    def evaluating(self) -> Any:
        """Every model in eval mode during an evaluation, as each was after it."""
        was = {name: m.training for name, m in self.models.items()}
        for model in self.models.values():
            model.eval()
        try:
            yield
        finally:
            for name, model in self.models.items():
                model.train(was[name])

