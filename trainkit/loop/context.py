"""A step you write: several named models and optimizers, driven through one context.

``Trainer.fit({"g": G, "d": D}, {"g": opt_g, "d": opt_d}, data, step=gan_step)`` calls
``gan_step(ctx, batch)`` once per micro-batch (once per optimizer step without accumulation),
inside the step's autocast. ``ctx.optimize(name, loss)`` does for that optimizer what trainkit's
own step does: the loss weighted by the micro-batch's share of the window, backward (scaled under
``16-mixed``), and at the window's last micro-batch unscale + clip, the NaN/inf guard (no host
read where the loop does not read anyway), ``optimizer.step``, ``zero_grad`` and its scheduler.
The loss scale is updated once per iteration, after every optimizer stepped (torch's recipe for
several optimizers). The context and the engine that runs a step function are in
:mod:`trainkit.loop.step` (the built-in step is one such function); this module holds what a fit
of named models adds: placing them, checkpointing them by name, evaluating with ``evaluate=``.
See docs/research.md, "Your own step".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainkit.core.errors import TrainkitError
from trainkit.loop.precision import Precision
from trainkit.loop.step import (
    Batch,
    ContextStep,
    Criterion,
    Forward,
    StepContext,
    add_scalars,
    targets_counter,
    times_count,
)
from trainkit.observe.metrics import DeviceMean

StepFn = Callable[["StepContext", Batch], Any]


def supervised_step(model: str, optimizer: str, forward: Forward,
                    criterion: Criterion) -> StepFn:
    """The built-in step as a step function: ``forward(model, batch)`` gives ``(outputs,
    targets)`` (optionally ``{name: scalar}`` too), ``criterion`` the loss (optionally
    ``(loss, {name: part})``), and optimizer ``optimizer`` steps on it."""

    def step(ctx: StepContext, batch: Batch) -> None:
        result = forward(ctx.models[model], batch)
        if len(result) not in (2, 3):
            raise TrainkitError(f"forward returned {len(result)} items: return (outputs, "
                                "targets) or (outputs, targets, {name: scalar})")
        if len(result) == 3:
            add_scalars(ctx.scalars, result[2])
        outputs, targets = result[0], result[1]
        del result  # as WindowStep: nothing of the forward alive but what the loss needs
        loss = criterion(outputs, targets)
        del outputs, targets
        if ctx.count is not None:  # a counted window: the criterion's mean back to a sum
            loss = times_count(loss, ctx.count)
        ctx.optimize(optimizer, loss)

    step.count_targets = targets_counter(forward)  # type: ignore[attr-defined]
    return step


def trained_models(models: Mapping[str, nn.Module],
                   optimizers: Mapping[str, Any]) -> dict[str, bool]:
    """Whether each model has a parameter some optimizer holds (a model none holds is frozen
    for the fit: not wrapped by DDP, kept in eval mode)."""
    held = {id(p) for opt in optimizers.values() for g in opt.param_groups for p in g["params"]}
    return {name: any(id(p) in held for p in model.parameters())
            for name, model in models.items()}


class NamedParts:
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
           evaluate: Any) -> tuple[NamedFit | None, nn.Module, Any, Any, Criterion | None]:
        """From ``fit``'s arguments: ``(named, model, optimizer, scheduler, criterion)``.

        ``named`` is None for today's form (one model, one optimizer, no ``step``), which keeps
        its parts; else the model and optimizer are the first-named ones and the scheduler None
        (the context steps each optimizer's). The criterion: default cross-entropy; with
        ``step=``, none unless given (it then only gives ``val/loss``). A lone model or
        optimizer is named ``"model"`` (so ``ctx.optimize("model", loss)``)."""
        if step is None and not isinstance(model, Mapping) and not isinstance(optimizer,
                                                                                Mapping):
            return None, model, optimizer, scheduler, criterion or F.cross_entropy
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
        named = cls(models, optimizers, step, schedulers, evaluate)
        return named, named.first_model, named.first_optimizer, None, criterion

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
        off); the first-named trained one as the step calls it."""
        from trainkit.distributed import strategy

        if mode:
            self.step_models = {name: strategy.compiled(model, mode) if self.trained[name]
                                else model for name, model in self.models.items()}
        # the first-named trained model: the one whose FLOPs the meter counts (place())
        return next((model for name, model in self.step_models.items() if self.trained[name]),
                    next(iter(self.step_models.values())))

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

    def checkpoint_parts(self) -> dict[str, Any]:
        """What a checkpoint holds besides a plain fit's parts. Several models or optimizers:
        each by name (``models``, ``optimizers``, ``schedulers``), beside ``model``/``optimizer``
        (the first-named's); one of each: the checkpoint of a plain fit, the scheduler as
        ``scheduler``."""
        from trainkit.distributed import ddp

        if len(self.models) == 1 and len(self.optimizers) == 1:
            return {"scheduler": next(iter(self.schedulers.values()), None)}
        return {"models": NamedParts({name: ddp.unwrap(m) for name, m in self.models.items()}),
                "optimizers": NamedParts(self.optimizers),
                "schedulers": NamedParts(self.schedulers)}

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

