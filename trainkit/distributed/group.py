"""The process group, the job's store and the votes: torch.distributed helpers that degrade to
no-ops in a single process (DDP wrapping is :mod:`trainkit.distributed.ddp`).

trainkit invents no launcher and no process group: torchrun (or SLURM's ``srun`` setting the same
variables) starts the processes, :func:`init_process_group` joins them through torchrun's
environment, and everything here is a no-op when there is one process.

Backends: gloo on CPU; on CUDA ``cpu:gloo,cuda:nccl``, so tensors on the GPU go through NCCL while
the small CPU-side agreements (stop votes, object collectives) use gloo and never make the host
wait for the GPU.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainkit.core.errors import TrainkitError

if TYPE_CHECKING:
    from trainkit.core.runtime import Runtime

# Seconds a collective may wait for a missing rank before failing (torch's defaults are 10-30
# minutes); a dead peer is usually noticed at once anyway, as gloo and NCCL see its sockets close.
TIMEOUT_ENV = "TRAINKIT_DIST_TIMEOUT_S"
# Seconds a rank leaving the group at its exit waits for the others (see leave_at_exit)
EXIT_WAIT_S = 5.0
_RUN_DIR_KEY = "trainkit/run_dir"
_job_stores: list[Any] = []  # the store init_process_group joined (one at most)
_cpu_group_cache: list[Any] = []  # [group] once made: a gloo group when the default has none
_shutdowns = itertools.count(1)  # numbers this process's shutdowns (every rank counts alike)


def is_distributed() -> bool:
    """True when a process group with more than one rank is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier(process_group: Any = None) -> None:
    """Wait for every rank (of ``process_group``, default all), on the CPU through gloo; nothing
    to wait for in a single process.

    Not ``dist.barrier``: on a group bound to a GPU it runs through NCCL, queued behind the GPU's
    work, and drains the GPU's queue at every checkpoint barrier; a CPU all-reduce waits for the
    ranks only.
    """
    if dist.is_available() and dist.is_initialized():
        on = process_group if process_group is not None else _cpu_group()
        dist.all_reduce(torch.zeros(1, dtype=torch.uint8), group=on)


def init_process_group(runtime: Runtime, *, timeout_s: float | None = None) -> bool:
    """Join the process group torchrun's environment describes; a no-op in a single process.

    The backend follows ``runtime.device``: gloo on CPU (no CUDA context), ``cpu:gloo,cuda:nccl``
    on CUDA (each rank bound to its GPU). Returns True when this call created the group: pair it
    with :func:`shutdown` (a normal exit leaves it too: :func:`leave_at_exit`).

    Args:
        runtime: this process's ranks and device (:meth:`Runtime.from_env`).
        timeout_s: how long a collective waits for a missing rank; default from the
            ``TRAINKIT_DIST_TIMEOUT_S`` environment variable, else torch's default.

    Raises:
        TrainkitError: ``WORLD_SIZE`` > 1 without the rendezvous variables torchrun sets.

    Example:
        >>> runtime = Runtime.from_env()  # doctest: +SKIP
        >>> init_process_group(runtime)
        >>> model = ddp.wrap_ddp(model.to(runtime.device), runtime)
    """
    if runtime.world_size <= 1 or not dist.is_available() or dist.is_initialized():
        return False
    connect_store(runtime, timeout_s=timeout_s)
    kwargs: dict[str, Any] = {"rank": runtime.rank, "world_size": runtime.world_size}
    timeout = _timeout(timeout_s)
    if timeout is not None:
        kwargs["timeout"] = timeout
    # torchrun's store outlives elastic restarts, and with it the keys through which the ranks of
    # an earlier attempt published their addresses: a fresh prefix per attempt keeps a restarted
    # group from dialling processes that no longer exist.
    kwargs["store"] = dist.PrefixStore(_attempt_prefix(), _job_stores[0])
    if runtime.device.type == "cuda":
        torch.cuda.set_device(runtime.device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=runtime.device, **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)
    atexit.register(leave_at_exit)
    return True


def connect_store(runtime: Runtime, *, timeout_s: float | None = None) -> bool:
    """Connect to the job's key-value store (once); False in a single process.

    Enough to agree on a run directory (:func:`shared_run_dir`) before the config is read, so
    the process group can wait for the device the config names.

    Raises:
        TrainkitError: ``WORLD_SIZE`` > 1 without the rendezvous variables torchrun sets.
    """
    if runtime.world_size <= 1 or not dist.is_available():
        return False
    if _job_stores:
        return True
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise TrainkitError(
            f"WORLD_SIZE={runtime.world_size} but {' and '.join(missing)} not set: start the "
            "processes with torchrun (see docs/distributed.md), or set RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT yourself"
        )
    _job_store(runtime, _timeout(timeout_s) or datetime.timedelta(minutes=30))
    return True


def _timeout(timeout_s: float | None) -> datetime.timedelta | None:
    """``timeout_s``, else ``TRAINKIT_DIST_TIMEOUT_S``, as a timedelta; None: torch's default."""
    seconds = timeout_s if timeout_s is not None else float(os.environ.get(TIMEOUT_ENV, 0))
    return datetime.timedelta(seconds=seconds) if seconds else None


def _job_store(runtime: Runtime, timeout: datetime.timedelta) -> dist.Store:
    """The job's key-value store: torchrun's agent store when it serves one, else rank 0's."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          runtime.world_size, is_master=not agent and runtime.rank == 0,
                          timeout=timeout)
    _job_stores[:] = [store]
    return store


def shutdown() -> None:
    """Leave the process group (``destroy_process_group``); nothing to do when there is none."""
    atexit.unregister(leave_at_exit)
    if dist.is_available() and dist.is_initialized():
        # No rank tears its connections down while another still reads from them (gloo aborts
        # the process when a peer vanishes mid-read): every rank first waits for all the others.
        if _job_stores and is_distributed():
            _store_barrier(_job_stores[0])
        else:
            dist.barrier(group=_cpu_group())
        dist.destroy_process_group()
    _cpu_group_cache.clear()


def leave_at_exit() -> None:
    """At the interpreter's exit (``atexit``, registered by :func:`init_process_group`): leave
    a group still up, as :func:`shutdown` does, when the process ends normally.

    Otherwise gloo's threads outlive finalization and a finished rank can abort (exit -6), which
    torchrun calls a failure. Not after an unhandled exception: that process should exit at once.
    The ranks wait ``EXIT_WAIT_S`` at most for each other; a stuck rank is left behind.
    """
    if getattr(sys, "last_value", None) is not None or not (
            dist.is_available() and dist.is_initialized()):
        return
    if _job_stores and is_distributed():
        # Not all came (a rank stuck, or this one failed with a one-line error that must stay
        # the last line: no store timeout's warnings), or the store is gone: leave anyway
        with contextlib.suppress(Exception):
            _store_barrier(_job_stores[0], wait_s=EXIT_WAIT_S)
    dist.destroy_process_group()
    _cpu_group_cache.clear()


def _store_barrier(store: dist.Store, wait_s: float | None = None) -> None:
    """Wait for every rank in the job's key-value store rather than with a gloo collective.

    A gloo barrier leaves tensors of collectives in flight to a worker thread that frees them
    later; where the group outlives ``destroy_process_group`` (FSDP's device mesh), that thread can
    still run as the interpreter finalizes and abort a finished process (exit -6).
    """
    key = f"{_attempt_prefix()}/shutdown_{next(_shutdowns)}"
    if store.add(key, 1) == dist.get_world_size():
        store.set(f"{key}/all", "1")
    if wait_s is None:
        store.wait([f"{key}/all"])
        return
    deadline = time.monotonic() + wait_s  # polled: a store's own timeout logs C++ warnings
    while not store.check([f"{key}/all"]) and time.monotonic() < deadline:
        time.sleep(0.01)


def sum_across_ranks(*values: torch.Tensor | float) -> list[float]:
    """Each value summed over all ranks, as floats (float64 on the way, so counts stay exact).

    One collective for all values; a single process gets its own values back.
    """
    if not is_distributed():
        return [float(v) for v in values]
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(())
                           for v in values])
    # numbers only: a CPU tensor, through gloo (a default group of NCCL alone refuses it)
    dist.all_reduce(stacked, group=_cpu_group() if device.type == "cpu" else None)
    return stacked.tolist()  # host sync: callers need the numbers


def gather_to_main(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` as a list indexed by rank on rank 0 (None on the others).

    A collective: every rank must call it. A single process gets ``[obj]``.
    """
    if not is_distributed():
        return [obj]
    rank = dist.get_rank()
    out: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=_cpu_group())
    return out


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, indexed by rank, on every rank (``[obj]`` in a single process)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_cpu_group())
    return out


def any_rank(*flags: bool) -> list[bool]:
    """Each flag OR-ed over all ranks, in one all-reduce of a few bytes on the CPU (gloo)."""
    if not is_distributed():
        return list(flags)
    votes = torch.tensor(flags, dtype=torch.uint8)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=_cpu_group())
    return [bool(v) for v in votes.tolist()]


class StepVote:
    """What every rank must decide alike at a step boundary, agreed in one small all-reduce.

    Flags travel together: "my loss is NaN/inf" (all skip the step), "I got a stop signal" (all
    stop after it), "a time-based checkpoint is due" (rank 0's clock only, so clock drift cannot
    split a save) and "my loss spiked" (all roll back: :attr:`spiked`). When the step's NaN check
    carried the vote, :meth:`stop_and_save` costs nothing; in one process each answer is its own.

    Args:
        stop: whether this rank wants to stop (a signal arrived).
        save_due: whether this rank's clock says a time-based checkpoint is due; None when
            the run saves by time never.
        spike: whether this rank saw a loss spike not yet acted on; None: never.
        log_due: whether this rank's clock says a time-based log is due (pass it on rank 0
            only: the loop's decision is then one rank's); None: never. Agreed flags add up in
            :attr:`log_due` until the loop takes it.
    """

    def __init__(self, stop: Callable[[], bool], save_due: Callable[[], bool] | None,
                 spike: Callable[[], bool] | None = None,
                 log_due: Callable[[], bool] | None = None) -> None:
        self._stop = stop
        self._save_due = save_due or _never  # None: no time-based saves
        self._spike = spike or _never
        self._log_due = log_due or _never
        self.log_due = False  # a time-based log agreed by a vote, not yet taken by the loop
        self._agreed: tuple[bool, bool] | None = None
        self.spiked = False  # any rank's spike, as agreed by the last stop_and_save
        self.active = is_distributed()

    def nonfinite(self, local: bool | torch.Tensor) -> bool | torch.Tensor:
        """Whether any rank's loss was NaN/inf; also agrees on stopping and saving.

        Given a 0-d tensor on a GPU, the answer is a tensor there, all-reduced by NCCL without
        the host waiting for it; stopping and saving are then agreed by :meth:`stop_and_save`.
        """
        if not self.active:
            return local
        if isinstance(local, torch.Tensor):
            if local.device.type != "cpu":
                flag = local.to(torch.uint8)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # queued on the GPU: no host read
                return flag.bool()
            return torch.tensor(self.nonfinite(bool(local)))  # a CPU tensor: reading it is free
        bad, stop, save, self.spiked, log = any_rank(local, self._stop(), self._save_due(),
                                                     self._spike(), self._log_due())
        self._agreed = (stop, save)
        self.log_due = self.log_due or log
        return bad

    def stop_and_save(self, again: bool = False) -> tuple[bool, bool]:
        """``(stop, save)`` as all ranks agreed for the step just taken.

        ``again``: vote anew even when the step's NaN/inf check carried the vote, for a stop asked
        for since (by a callback after the step); every rank must pass the same.
        """
        if not self.active:  # one process: nothing to agree on
            self.spiked = self._spike()
            return self._stop(), self._save_due()
        if self._agreed is None or again:
            self._agreed = None
            # a spike agreed in the step's own vote stays pending (the flag is), so it is voted
            _, stop, save, self.spiked, log = any_rank(False, self._stop(), self._save_due(),
                                                       self._spike(), self._log_due())
            self.log_due = self.log_due or log
            return stop, save
        agreed, self._agreed = self._agreed, None
        return agreed


def _never() -> bool:
    return False


def shared_run_dir(run_dir: str | None = None) -> str | None:
    """The run directory every rank uses, kept by the rendezvous store across elastic restarts.

    Rank 0 passes the folder Hydra made for it and gets back the one of the run's first attempt
    (its own on the first attempt); any rank passing None waits for rank 0's answer (when the
    store has none yet) or gets it. A single process gets ``run_dir`` back.
    """
    if not _job_stores:  # one process (connect_store made no store)
        return run_dir
    store = _job_stores[0]  # torchrun's store: outlives restarts
    if run_dir is not None:
        return store.compare_set(_RUN_DIR_KEY, "", run_dir).decode()
    return store.get(_RUN_DIR_KEY).decode()  # blocks until rank 0 has set it


def published_run_dir() -> str | None:
    """The run directory an earlier attempt of this torchrun job used, if any (no waiting)."""
    if not _job_stores:
        return None
    store = _job_stores[0]
    return store.get(_RUN_DIR_KEY).decode() if store.check([_RUN_DIR_KEY]) else None


def attempt_store(namespace: str) -> dist.Store | None:
    """``namespace`` in the job's key-value store, for this attempt of the job only.

    For small notes between ranks off the collectives' path (the hang watchdog's heartbeats).
    None in a single process, or when the process group was not joined through
    :func:`init_process_group`.
    """
    if not is_distributed() or not _job_stores:
        return None
    return dist.PrefixStore(f"{_attempt_prefix()}/{namespace}", _job_stores[0])


def collectives_issued() -> int | None:
    """How many collectives this rank has issued on the default group; None where unknown.

    Ranks stuck at the same step differ here: those waiting inside a collective have issued it,
    the rank they wait for has not. Counted over the group's backends (gloo's agreements and
    NCCL's gradients under ``cpu:gloo,cuda:nccl``). A private counter of torch's process groups,
    read only to name the rank a hang waits for: anything unexpected gives None.
    """
    if not is_distributed():
        return None
    group = dist.distributed_c10d._get_default_group()
    counts: dict[str, int] = {}
    for device in ("cpu", "cuda"):
        with contextlib.suppress(Exception):  # no backend for that device
            backend = group._get_backend(torch.device(device))
            counts[type(backend).__name__] = int(backend._get_sequence_number_for_group())
    return sum(counts.values()) if counts else None


def _attempt_prefix() -> str:
    # torchrun's store outlives elastic restarts: keys of an earlier attempt must not be read.
    return f"trainkit/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _cpu_group() -> Any:
    """A group that takes CPU tensors: the default one unless it is NCCL alone."""
    if "gloo" in str(dist.get_backend()):
        return None
    if not _cpu_group_cache:  # a collective: every rank reaches this at the same call
        _cpu_group_cache.append(dist.new_group(backend="gloo"))
    return _cpu_group_cache[0]


def check_same_start(step: int) -> None:
    """All ranks must resume from the same step (say, a run dir that not every node sees)."""
    steps = all_gather(step)
    if len(set(steps)) > 1:
        raise TrainkitError(
            "ranks would start from different steps: every node must see the same run dir and "
            "checkpoints; put run_dir on a shared filesystem",
            details=[f"steps to start from, by rank: {steps}"])
