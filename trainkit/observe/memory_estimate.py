"""Peak memory of a training step, measured on meta tensors: no weights allocated, no GPU.

One step (forward, backward, optimizer step: the caller's, ``trainkit estimate`` gives
trainkit's own loop step) runs on a model built on the ``meta`` device,
under :class:`LiveBytes`, a dispatch mode that adds up the bytes of every tensor storage alive
after each operator. The same mode around a real step (on the CPU, say) measures the live tensor
memory that step had, so the two are measured alike (tests compare them). Mixed precision is
followed by :class:`MixedPrecisionCasts`: autocast does not act on meta tensors, so the casts it
would make (matmuls and convolutions in the low precision, losses and norms in float32) are
made at the function level, where autograd records them as autocast's own. Attention runs as a
fused kernel would store it (its output and log-sum-exp), not as the meta device's math path.

Public torch APIs only, but for ``torch.utils._python_dispatch.TorchDispatchMode`` (the one way
to see every operator's outputs; its documented home, torch's "Extending PyTorch" notes, names
it there).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from trainkit.core.tree import tensors, tree_map

GIB = 2**30
_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class LiveBytes(TorchDispatchMode):
    """The bytes of every tensor storage alive, after each operator, and their peak.

    Tensors made before the mode (weights, optimizer state, the batch) count once
    :meth:`track` is given them; each storage counts once, whatever views share it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self._alive: dict[int, weakref.ref[Any]] = {}

    def track(self, tensors: Iterable[Any]) -> None:
        """Count these tensors' storages (``None`` and non-tensors are skipped)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.current)

    def _add(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage of its own (a wrapper subclass)
            return
        key = id(storage)
        if key in self._alive:
            return
        size = storage.nbytes()

        def freed(_: Any, key: int = key, size: int = size) -> None:
            if self._alive.pop(key, None) is not None:
                self.current -= size

        self._alive[key] = weakref.ref(storage, freed)
        self.current += size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tensors(out):
            self._add(t)
        self.peak = max(self.peak, self.current)
        return out


# What autocast runs in the low precision, and in float32, by device type (torch's amp docs,
# "Autocast Op Reference"): the functions a model calls for those operators.
_LOW = {F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
        F.conv_transpose3d, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
        torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.baddbmm,
        torch.addbmm, F.scaled_dot_product_attention}
_LOSSES = {F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
           F.kl_div, F.binary_cross_entropy_with_logits}
_FLOAT32 = {"cpu": _LOSSES,
            "cuda": _LOSSES | {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax,
                               torch.Tensor.softmax, torch.Tensor.log_softmax, F.layer_norm,
                               F.group_norm, torch.logsumexp, torch.Tensor.logsumexp}}


class MixedPrecisionCasts(TorchFunctionMode):
    """Autocast's casts at the function level, for tensors autocast does not see (meta).

    Low-precision functions get their floating inputs cast to ``dtype``, float32 ones to
    float32 (``dtype`` None: no casts); a weight (a leaf that requires grad) is cast once while
    the mode is entered, as autocast caches it. Attention is run as fused kernels keep it
    (:class:`_FusedAttention`).
    """

    def __init__(self, dtype: torch.dtype | None, device_type: str) -> None:
        super().__init__()
        self.dtype, self.float32 = dtype, _FLOAT32.get(device_type, _LOSSES)
        self._cache: dict[int, torch.Tensor] = {}

    def __exit__(self, *exc: Any) -> None:
        self._cache.clear()
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if self.dtype is None:  # float32: attention alone is changed
            pass
        elif func in _LOW:
            args, kwargs = tree_map(lambda t: self._cast(t, self.dtype), (args, kwargs))
        elif func in self.float32:
            args, kwargs = tree_map(lambda t: self._cast(t, torch.float32), (args, kwargs))
        if func is F.scaled_dot_product_attention:
            return fused_attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _cast(self, t: Any, dtype: torch.dtype) -> Any:
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()) or t.dtype in (
                dtype, torch.float64):
            return t
        if not (t.is_leaf and t.requires_grad):
            return t.to(dtype)
        if id(t) not in self._cache:
            self._cache[id(t)] = t.to(dtype)
        return self._cache[id(t)]


class _FusedAttention(torch.autograd.Function):
    """Attention as flash/memory-efficient kernels keep it: the output and a float32
    log-sum-exp per query saved for backward, no ``[T, S]`` matrix (the meta device's
    math path would make one)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                    *args: Any, **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on meta tensors as a fused kernel would store it; with
    a mask (a path that materialises scores on some devices): torch's own."""
    if attn_mask is not None or q.device.type != "meta":
        return F.scaled_dot_product_attention(q, k, v, attn_mask, *args, **kwargs)
    return _FusedAttention.apply(q, k, v)


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages among ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor in the optimizer's state (moments, momentum buffers, step counts)."""
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


@dataclass
class StepMemory:
    """One step's memory, in bytes: its peak, and what was alive throughout it."""

    peak: int
    params: int
    grads: int  # the gradients of the parameters that train
    optimizer_state: int
    extra: int = 0  # other tensors alive the whole step (an EMA copy, the batch)
    # bytes of the parameters outside the model's repeated blocks, and of its largest block
    blocks: tuple[int, int] = (0, 0)
    notes: list[str] = field(default_factory=list)

    @property
    def activations(self) -> int:
        """The rest of the peak: activations saved for backward, temporaries, casts."""
        return max(0, self.peak - self.params - self.grads - self.optimizer_state - self.extra)


@dataclass
class StepSpec:
    """How one step runs: what the model gets, in what precision, in how many micro-batches."""

    forward: Callable[[nn.Module, Any], Sequence[Any]]
    criterion: Callable[[Any, Any], torch.Tensor]
    micro_batches: int = 1  # per optimizer step (accumulation x split batches)
    precision: str = "32"  # 32, bf16-mixed, 16-mixed
    device_type: str = "cuda"  # whose autocast the casts follow
    clip: bool = False
    extra: Sequence[torch.Tensor] = ()  # tensors alive the whole step (an EMA copy)
    # the run's optimizer is a fused kernel: in place, no temporaries (meta has none: its
    # per-tensor loop made the state in the first step and is left out of the traced one)
    fused: bool = False


# One optimizer step over a window of micro-batches, ``update`` False leaving
# ``optimizer.step`` out (a fused kernel's allocates nothing): the run's own step, given by the
# caller (``trainkit estimate`` runs trainkit's loop step, whose layer is above this one).
RunStep = Callable[[Sequence[Any], bool], Any]


def casts_for(spec: StepSpec) -> MixedPrecisionCasts:
    """The casts ``spec``'s precision makes, for a step on meta tensors (autocast's)."""
    return MixedPrecisionCasts(_DTYPES.get(spec.precision), spec.device_type)


def checkpoint_blocks(model: nn.Module, names: Sequence[str], precision: str,
                      device_type: str) -> None:
    """Activation checkpointing of the modules ``names`` (non-reentrant, as training's) for a
    traced step: their recomputation in backward casts as their forward did (the backward runs
    outside :class:`MixedPrecisionCasts`, so it is entered again around each recomputation)."""
    dtype = _DTYPES.get(precision)
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        module.forward = functools.partial(_checkpointed, module.forward, dtype, device_type)


def _checkpointed(forward: Any, dtype: torch.dtype | None, device_type: str, *args: Any,
                  **kwargs: Any) -> Any:
    def contexts() -> tuple[Any, Any]:
        return contextlib.nullcontext(), MixedPrecisionCasts(dtype, device_type)

    return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def measure_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                 make_batch: Callable[[], Any], spec: StepSpec, run: RunStep) -> StepMemory:
    """The peak live tensor memory of a steady-state step ``run``: one step first (the
    optimizer's state is made), then one under :class:`LiveBytes`, with the weights, their
    state, the ``spec.extra`` tensors and the batches counted from its start."""
    run([make_batch() for _ in range(spec.micro_batches)], True)
    batches = [make_batch() for _ in range(spec.micro_batches)]
    params = [p for p in model.parameters()] + [b for b in model.buffers()]
    state = list(optimizer_tensors(optimizer))
    tracker = LiveBytes()
    tracker.track([*params, *state, *spec.extra, *tensors(batches)])
    with tracker:
        run(batches, not spec.fused)
    trained = [p for p in model.parameters() if p.requires_grad]
    return StepMemory(peak=tracker.peak, params=tensor_bytes(params),
                      grads=tensor_bytes(trained), optimizer_state=tensor_bytes(state),
                      extra=tensor_bytes([*spec.extra, *tensors(batches)]))
