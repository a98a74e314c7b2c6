"""Fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``) for training.

Under ``trainer.strategy=fsdp`` each rank keeps 1/world_size of every weight, gradient and
optimizer state; a block's full weights exist only while it runs. :func:`shard_model` shards the
``trainer.fsdp_blocks`` (or :func:`default_blocks`), then the root. The wrappers go as in
torchtitan: activation checkpointing, ``fully_shard``, ``torch.compile`` last; parameter names
stay, so ``ddp.unwrap(model).state_dict()`` has the usual keys, as DTensors.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from trainkit.core.errors import TrainkitError, chain_lines, one_line
from trainkit.core.runtime import Runtime
from trainkit.core.submodules import match_modules, repeated_blocks

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

log = logging.getLogger("trainkit")
# Parameters (and hence all-gathers and compute) in the low precision; gradients reduced and
# master weights kept in float32.
_PARAM_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def resolve_strategy(strategy: str, world_size: int) -> str:
    """``"fsdp"``, ``"ddp"`` or ``"none"`` (a plain model) for ``trainer.strategy``.

    ``auto`` is DDP over several ranks and nothing in one process; ``ddp`` in one process is
    the plain model; ``fsdp`` shards in one process too, on a 1-rank mesh (the same code path
    and state as a sharded run: for resuming a sharded checkpoint on one process).
    """
    if strategy == "fsdp":
        return "fsdp"
    return "ddp" if world_size > 1 else "none"


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (inside a ``torch.compile`` wrapper or not) was sharded by FSDP2."""
    # torch's FSDP is imported only when something shards (its import costs ~0.5 s, sympy
    # included): until then no module can be an FSDPModule, and nothing needs importing here.
    torch_fsdp = sys.modules.get("torch.distributed.fsdp")
    return torch_fsdp is not None and isinstance(model._modules.get("_orig_mod", model),
                                                 torch_fsdp.FSDPModule)


def default_blocks(model: nn.Module) -> list[str]:
    """The blocks sharded when ``trainer.fsdp_blocks`` names none: the model's repeated blocks
    (:func:`trainkit.core.submodules.repeated_blocks`: the instances of its largest repeated
    block class -- a transformer's layers, a ResNet's stages). A model with no repeated class has
    no blocks: the root alone is one unit (gathered whole for each step).
    """
    return repeated_blocks(model)


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``trainer.precision``: low-precision params, float32 reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = _PARAM_DTYPES.get(precision)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard_model(model: nn.Module, optimizer: torch.optim.Optimizer | None, runtime: Runtime, *,
                blocks: Sequence[str] = (), reshard_after_forward: bool = True,
                precision: str = "32") -> nn.Module:
    """``fully_shard`` the named blocks (or :func:`default_blocks`), then the root.

    Every rank starts from rank 0's weights (broadcast first, as DDP does); the ``optimizer`` is
    pointed at the sharded parameters; a 1-rank group is joined when none is up. Under mixed
    precision batch-norm layers are float32 units of their own (:func:`float32_norms`).

    Args:
        model: the model, on ``runtime.device``, its parameters contiguous (``fully_shard``
            refuses others: under FSDP, ``channels_last`` is the inputs' layout only).
        optimizer: built on ``model.parameters()``, not stepped yet; None: none to update.
        runtime: the device and ranks (the mesh spans all ranks).
        blocks: class names or module paths (``trainer.fsdp_blocks``); empty: the default.
        reshard_after_forward: free each block's gathered weights after its forward (gathered
            again in backward): less memory, one more all-gather per block and step.
        precision: ``trainer.precision``; mixed precision runs with the params in bf16/fp16
            and gradients reduced in float32 (``MixedPrecisionPolicy``).

    Raises:
        ConfigError: a name in ``blocks`` matches nothing in the model.
        TrainkitError: the optimizer has already stepped (its state is of unsharded params), or
            ``fully_shard`` refused a module (non-contiguous parameters, say).

    Example:
        >>> model = shard_model(model.to(runtime.device), optimizer, runtime,
        ...                     blocks=["TransformerEncoderLayer"])  # doctest: +SKIP
    """
    from torch.distributed.device_mesh import init_device_mesh

    names = (match_modules(model, blocks, "trainer.fsdp_blocks", nested=True) if blocks
             else default_blocks(model))
    if optimizer is not None and optimizer.state:
        raise TrainkitError("trainer.strategy=fsdp needs an optimizer that has not stepped yet "
                            "(its state is of the unsharded parameters): build it afresh")
    norms = float32_norms(model, names) if precision in _PARAM_DTYPES else []
    described = _describe(model, names)  # before fully_shard renames the classes (FSDPLinear)
    _join_one_rank_group(runtime)
    _broadcast_from_rank0(model)
    before = {id(p): name for name, p in model.named_parameters()}
    mesh = init_device_mesh(runtime.device.type, (dist.get_world_size(),))
    settings: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    modules = dict(model.named_modules())
    # fully_shard goes bottom-up: the norms (leaves) first, then the blocks innermost first
    units = [(name, mixed_precision("32")) for name in norms]
    units += [(name, mixed_precision(precision)) for name in [*reversed(names), ""]]
    for name, policy in units:
        _fully_shard(modules[name], name, mp_policy=policy, **settings)
    if optimizer is not None:
        _rebind(optimizer, before, dict(model.named_parameters()))
    log.info("fsdp: %s sharded over %d rank%s (+ the root)%s%s", described,
             dist.get_world_size(), "" if dist.get_world_size() == 1 else "s",
             f"; {len(norms)} norm layers with running statistics kept in float32 (units of "
             f"their own)" if norms else "",
             "" if reshard_after_forward else "; weights kept gathered after forward")
    return model


def float32_norms(model: nn.Module, blocks: Sequence[str] = ()) -> list[str]:
    """Modules to shard as float32 units of their own under mixed precision: norm layers.

    FSDP's ``MixedPrecisionPolicy`` casts parameters, never buffers, so batch-norm's bf16 weight
    beside its float32 running statistics fails. The rule: a module with parameters and
    floating-point buffers of its own; named ``blocks`` keep their own policy.
    """
    return [name for name, module in model.named_modules()
            if name and name not in blocks
            and any(True for _ in module.parameters(recurse=False))
            and any(b.is_floating_point() for b in module.buffers(recurse=False))]


def compile_units(model: nn.Module) -> tuple[list[str], list[str]]:
    """``torch.compile`` each FSDP unit's forward in place: ``(compiled, left eager)`` paths.

    Compiling the sharded model whole compiles nothing (FSDP2's hooks are excluded from tracing and
    the graph break leaves every forward eager); per unit, as torchtitan does, the hooks run around
    each compiled forward. One-layer units have nothing to fuse and stay eager. The forward is
    patched, so parameter names do not change.
    """
    compiled: dict[Any, Any] = {}
    done, eager = [], []
    for name, module in model.named_modules():
        if not is_sharded(module):
            continue
        if not any(True for _ in module.children()):
            eager.append(name)
            continue
        done.append(name or "<root>")
        if "forward" in vars(module):  # patched already (activation checkpointing)
            module.forward = torch.compile(module.forward)
            continue
        # One compiled function per class, the module an argument: a compiled bound method is
        # guarded on its module's identity, and past dynamo's recompile_limit (8) units of
        # one class would silently run eagerly.
        forward = type(module).forward
        if forward not in compiled:
            compiled[forward] = torch.compile(forward)
        module.forward = functools.partial(compiled[forward], module)
    return done, eager


def _fully_shard(module: nn.Module, name: str, **settings: Any) -> None:
    """``fully_shard(module)``; its refusal as one line naming the option to change."""
    from torch.distributed.fsdp import fully_shard

    try:
        fully_shard(module, **settings)
    except (NotImplementedError, ValueError, TypeError, AssertionError) as err:
        where = f"{name} ({type(module).__name__})" if name else type(module).__name__
        raise TrainkitError(
            f"trainer.strategy=fsdp: fully_shard refuses {where} ({type(err).__name__}: "
            f"{one_line(err, 60)}); use trainer.strategy=ddp or other trainer.fsdp_blocks",
            details=chain_lines(err)) from err


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Context for a backward that only accumulates: no reduce-scatter, no resharding.

    Gradients stay unsharded (in float32 under mixed precision) until the last micro-batch's
    backward reduces them; the gathered weights stay too, so the next forward gathers nothing.
    """
    return _accumulating(model._modules.get("_orig_mod", model))


@contextlib.contextmanager
def _accumulating(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


def reshard(model: nn.Module) -> None:
    """Free every gathered weight, so the next forward gathers the current shards.

    After a forward without backward (evaluation) FSDP keeps some weights gathered (the root's
    always): weights changed in place afterwards (EMA swapped in or out) would otherwise be
    missed by the next forward.
    """
    for module in model.modules():
        if is_sharded(module):
            module.reshard()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage); a plain tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _join_one_rank_group(runtime: Runtime) -> None:
    """A 1-rank process group for one process (FSDP2 needs a mesh); none when one is up."""
    if dist.is_initialized():
        return
    if runtime.world_size > 1:
        raise TrainkitError("trainer.strategy=fsdp over several ranks needs the process group "
                            "(call distributed.init_process_group first)")
    backend = "cpu:gloo,cuda:nccl" if runtime.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _broadcast_from_rank0(model: nn.Module) -> None:
    """Rank 0's weights and buffers on every rank: ``fully_shard`` keeps each rank's own slice,
    so ranks that initialized differently would otherwise train a patchwork."""
    if dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)


def _rebind(optimizer: torch.optim.Optimizer, before: dict[int, str],
            after: dict[str, nn.Parameter]) -> None:
    """Point the optimizer's param groups at the sharded parameters that replaced theirs."""
    for group in optimizer.param_groups:
        group["params"] = [after[before[id(p)]] if id(p) in before else p
                           for p in group["params"]]


def _describe(model: nn.Module, names: list[str]) -> str:
    """``"Linear x2 (net.1, net.3)"``, or ``"no blocks"``."""
    if not names:
        return "no blocks"
    modules = dict(model.named_modules())
    counts = collections.Counter(type(modules[name]).__name__ for name in names)
    paths = names if len(names) <= 4 else [*names[:2], "...", names[-1]]
    return f"{', '.join(f'{c} x{n}' for c, n in counts.items())} ({', '.join(paths)})"
