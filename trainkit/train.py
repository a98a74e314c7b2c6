"""``python -m trainkit.train +exp=mnist``: compose the config with Hydra, then train.

This is the only module that imports Hydra. ``train(cfg, run_dir)`` reads top to bottom:
settings -> runtime -> data -> model -> optimizer -> trainer.fit -> summary.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import hydra
import torch
import torch.distributed
import torch.nn.functional as F
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainkit import distributed
from trainkit.config import TrainConfig
from trainkit.config_dir import config_dir
from trainkit.cuda_settings import use_device
from trainkit.data import build_loaders
from trainkit.errors import TrainkitError, chain_lines, one_line, print_error
from trainkit.logging import log_to_file, setup_logging
from trainkit.rng import seed_everything
from trainkit.run_dir import removed_if_unused
from trainkit.runtime import Runtime
from trainkit.signals import EXIT_PREEMPTED, StoppedOutsideTraining, stop_outside_training
from trainkit.trainer import Trainer

CONFIG_DIR = str(config_dir())
ConfigStore.instance().store(name="train_schema", node=TrainConfig)
# Users who set HYDRA_FULL_ERROR=1 get full tracebacks; read before main() sets it for itself.
_SHOW_TRACEBACK = os.environ.get("HYDRA_FULL_ERROR") == "1"
# What the communication backends say when a peer process is gone or a collective timed out.
_BACKEND_ERROR = re.compile(r"gloo|nccl|c10d|ProcessGroup|(closed|reset) by peer", re.IGNORECASE)


def train(cfg: DictConfig, run_dir: str | Path, *, stop_at_step: int | None = None
          ) -> dict[str, Any]:
    """Run one training job described by a composed config; return its summary.

    ``stop_at_step`` stops after that step as a preemption would (for verify_resume).
    """
    settings: TrainConfig = OmegaConf.to_object(cfg)  # type checks done; ranges checked here
    runtime = Runtime.from_env(settings.trainer.device)
    use_device(runtime.device)  # current before anything touches CUDA (also cuda:1 alone)
    distributed.init_process_group(runtime)  # backend by device: gloo for cpu, NCCL for cuda
    log = setup_logging(run_dir, runtime.is_main)
    seed_everything(settings.trainer.seed)

    # Your own dataset (a `dataset._target_` node) replaces the built-in one named by data.name.
    reader = instantiate(cfg.dataset, _partial_=True) if cfg.get("dataset") is not None else None
    train_data, val_data, num_classes = build_loaders(
        settings.data, runtime, seed=settings.trainer.seed,
        channels_last=settings.trainer.channels_last, reader=reader,
    )
    model = instantiate(cfg.model, _convert_="all")
    optimizer = instantiate(cfg.optim, params=model.parameters(), _convert_="all")
    trainer = Trainer(settings.trainer, run_dir=run_dir, checkpoint=settings.checkpoint,
                      runtime=runtime, run_config=OmegaConf.to_container(cfg, resolve=True))
    # A criterion from the config (e.g. label smoothing); default: plain cross-entropy.
    criterion = instantiate(cfg.loss) if cfg.get("loss") is not None else F.cross_entropy
    scheduler = None
    if cfg.sched is not None:
        total_steps = trainer.planned_steps(len(train_data))
        scheduler = instantiate(cfg.sched, optimizer=optimizer, total_steps=total_steps)

    from torchmetrics.classification import MulticlassAccuracy  # heavy import: after data is up

    summary = trainer.fit(
        model, optimizer, train_data, criterion=criterion, scheduler=scheduler, val_data=val_data,
        metrics={"acc": MulticlassAccuracy(num_classes, average="micro")},
        stop_at_step=stop_at_step,
    )
    if summary["status"] == "completed":
        log.info("done: test accuracy %.4f after %d steps in %.1f s; run dir %s",
                 summary["metrics"].get("val/acc", float("nan")), summary["global_step"],
                 summary["wall_time_s"], run_dir)
    return summary


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    # Errors are reported here, inside the job: past this point Hydra would add its own lines.
    with errors_as_one_line():
        run_dir = HydraConfig.get().runtime.output_dir
        if Runtime.from_env("cpu").is_main:
            run_dir = distributed.shared_run_dir(run_dir)  # tell the other ranks; see _join_ranks
        with removed_if_unused(run_dir):  # a config error leaves no folder of Hydra's files only
            summary = train(cfg, run_dir)
    distributed.shutdown()
    if summary["status"] == "preempted":
        sys.exit(EXIT_PREEMPTED)  # documented: checkpoint saved, re-run the command to resume


def main() -> None:
    """Run the Hydra app; user errors print as one line and exit with status 2."""
    stop_outside_training()  # a signal before the first step: one line and exit 75, not death
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let composition errors reach us unprinted
    with errors_as_one_line():
        sys.argv += _join_ranks()
        _hydra_main()


def _join_ranks() -> list[str]:
    """Under torchrun: agree on one run directory before Hydra, through the job's store.

    Hydra names the run directory per process (``${now:...}`` differs between ranks), and makes
    it and ``.hydra/`` before the job starts. So rank 0 composes first and publishes its folder
    in torchrun's rendezvous store; the other ranks wait for it and are told to use it, without
    writing a ``.hydra/`` of their own. The store outlives elastic restarts: a restarted group
    finds the first attempt's folder there, and resumes from its checkpoints.

    The process group is joined later, in :func:`train`, once the config names the device (and
    so the backend: a ``trainer.device=cpu`` job on a GPU machine never touches CUDA).

    Returns the Hydra overrides that make this rank use the shared folder (none in one process).
    """
    runtime = Runtime.from_env("cpu")  # ranks only: the device is the config's to say
    if not distributed.connect_store(runtime):
        return []
    run_dir = distributed.published_run_dir()  # set when this is an elastic restart
    if run_dir is None and not runtime.is_main:
        run_dir = distributed.shared_run_dir()  # waits until rank 0's Hydra has made it
    overrides = [] if run_dir is None else [f"hydra.run.dir={_quoted(run_dir)}"]
    if not runtime.is_main:
        overrides.append("hydra.output_subdir=null")
    return overrides


def _quoted(value: str) -> str:
    """``value`` as a quoted Hydra override value (paths may hold spaces, '=' or ',')."""
    return "'" + value.replace("'", "\\'") + "'"


@contextlib.contextmanager
def errors_as_one_line() -> Iterator[None]:
    """Turn user errors into a short last line (details before it), also written to train.log."""
    try:
        yield
    except (TrainkitError, HydraException, OmegaConfBaseException) as err:
        if _SHOW_TRACEBACK:
            raise
        if isinstance(err, TrainkitError):
            _fail(str(err), details=err.details)
        if isinstance(err, InstantiationException):  # a `_target_` that fails to import or build
            _fail(_instantiate_message(err), details=chain_lines(err.__cause__ or err))
        _fail(f"config error: {_fold_hydra_message(err)}")
    except torch.cuda.OutOfMemoryError as err:  # before fit, which reports its own (status oom)
        if _SHOW_TRACEBACK:
            raise
        _fail(f"out of memory before training started: {one_line(err, 80)}; free the GPU "
              "(nvidia-smi shows who holds it) or use data.loader=dataloader")
    except RuntimeError as err:
        if _SHOW_TRACEBACK or not _from_collective(err):
            _log_traceback(err)
            raise
        # Another rank died (its own error is above) and took the collective with it.
        _fail("lost contact with another rank, which probably failed; see its error above",
              details=chain_lines(err), status=1)
    except StoppedOutsideTraining as stop:  # nothing to save yet; a requeue loop re-runs it
        _fail(stop.message, status=EXIT_PREEMPTED)
    except KeyboardInterrupt:  # a second Ctrl-C (or signal) while stopping: abort, no save
        if _SHOW_TRACEBACK:
            raise
        _fail("aborted without saving; re-run the same command to resume from the last "
              "checkpoint", status=130)
    except Exception as err:  # a bug, not bad input: the traceback stays, and the log keeps it
        _log_traceback(err)
        raise


def _log_traceback(err: BaseException) -> None:
    """Write ``err``'s traceback to train.log once (the contexts nest: main and the Hydra job)."""
    if not getattr(err, "_trainkit_logged", False):
        log_to_file("".join(traceback.format_exception(err)).splitlines())
        err._trainkit_logged = True  # type: ignore[attr-defined]


def _fail(message: str, *, details: Sequence[str] = (), status: int = 2) -> NoReturn:
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = f"rank {os.environ.get('RANK', 0)}: " if world_size > 1 else ""
    lines = print_error(message, details, prefix=f"trainkit: {rank}")
    log_to_file(lines)  # the run's train.log, when this process writes one
    sys.exit(status)


def _from_collective(err: BaseException) -> bool:
    """Whether ``err`` came out of a torch.distributed call (a peer vanished, a timeout)."""
    if isinstance(err, torch.distributed.DistError) or _BACKEND_ERROR.search(str(err)):
        return True  # gloo/NCCL errors often surface as plain RuntimeErrors from autograd/DDP
    marker = os.sep.join(("torch", "distributed", ""))
    return any(marker in frame.filename for frame in traceback.extract_tb(err.__traceback__))


def _instantiate_message(err: InstantiationException) -> str:
    """What went wrong building a config's ``_target_`` (its import or its call), and the fix."""
    text = str(err)
    key = (re.findall(r"full_key: (\S+)", text) or ["a config node"])[0]
    target = (re.findall(r"target '([^']+)'", text) or ["?"])[0]
    if "Error locating target" in text:
        return (f"cannot import {key}._target_={target}: check the name, and that its module is "
                "importable from here (installed, or on PYTHONPATH)")
    unexpected = re.findall(r"unexpected keyword argument '(\w+)'", text)
    if unexpected:
        return (f"{target} takes no argument '{unexpected[0]}' ({key}.{unexpected[0]}): drop it "
                f"with ~{key}.{unexpected[0]}, or give {key} a config group of its own")
    return f"config error: cannot build {key} ({target}); the error is above"


def _fold_hydra_message(err: BaseException) -> str:
    """Fold Hydra/OmegaConf's multi-line messages into one line, keeping what says how to fix."""
    text = str(err).split("Config search path")[0]
    parts: list[str] = []
    listing = False
    for line in (raw.strip() for raw in text.splitlines()):
        if not line:
            continue
        if parts and (parts[-1].endswith(":") or listing):
            parts[-1] += (", " if listing else " ") + line  # "options in 'exp':" then one a line
            listing = True
        else:
            parts.append(line)
            listing = False
    cause = err.__cause__
    if isinstance(cause, OmegaConfBaseException):
        first = str(cause).strip().splitlines()[0]
        key = getattr(cause, "full_key", None)
        parts.append(first + (f" (key: {key})" if key else ""))
    return "; ".join(parts)


if __name__ == "__main__":
    main()
