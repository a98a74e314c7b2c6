"""``python -m trainkit.train +exp=mnist``: compose the config with Hydra, then train.

Only the entry point imports Hydra: this module, and its error folding
(:mod:`trainkit.entry.errors`) and rank joining (:mod:`trainkit.distributed.entry_ranks`).
``train(cfg, run_dir)`` reads top to bottom: settings -> runtime -> data -> model -> optimizer ->
trainer.fit -> summary.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

import hydra
import torch.nn.functional as F
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from trainkit.config import TrainConfig
from trainkit.data import build_loaders
from trainkit.distributed import group
from trainkit.distributed.entry_ranks import join_ranks
from trainkit.entry.config_dir import config_dir
from trainkit.entry.errors import errors_as_one_line
from trainkit.entry.run_dir import removed_if_unused
from trainkit.loop.accuracy import Accuracy
from trainkit.loop.cuda_settings import use_device
from trainkit.loop.trainer import Trainer
from trainkit.observe.logging import setup_logging
from trainkit.rng import seed_everything
from trainkit.runtime import Runtime
from trainkit.signals import EXIT_PREEMPTED, stop_outside_training

CONFIG_DIR = str(config_dir())
ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def train(cfg: DictConfig, run_dir: str | Path, *, stop_at_step: int | None = None
          ) -> dict[str, Any]:
    """Run one training job described by a composed config; return its summary.

    ``stop_at_step`` stops after that step as a preemption would (for verify_resume).
    """
    settings: TrainConfig = OmegaConf.to_object(cfg)  # type checks done; ranges checked here
    runtime = Runtime.from_env(settings.trainer.device)
    use_device(runtime.device)  # current before anything touches CUDA (also cuda:1 alone)
    group.init_process_group(runtime)  # backend by device: gloo for cpu, NCCL for cuda
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

    # trainkit's own counter, not torchmetrics': importing that costs ~2 s (torchvision, dynamo).
    summary = trainer.fit(
        model, optimizer, train_data, criterion=criterion, scheduler=scheduler, val_data=val_data,
        metrics={"acc": Accuracy(num_classes)},
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
        # Under torchrun rank 0 tells the others (waiting in join_ranks) its folder; theirs is
        # that one already, and an elastic restart's is the first attempt's: all get the same.
        run_dir = group.shared_run_dir(HydraConfig.get().runtime.output_dir)
        with removed_if_unused(run_dir):  # a config error leaves no folder of Hydra's files only
            summary = train(cfg, run_dir)
    group.shutdown()
    if summary["status"] == "preempted":
        sys.exit(EXIT_PREEMPTED)  # documented: checkpoint saved, re-run the command to resume


def main() -> None:
    """Run the Hydra app; user errors print as one line and exit with status 2."""
    stop_outside_training()  # a signal before the first step: one line and exit 75, not death
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let composition errors reach us unprinted
    _compose_once()
    try:
        with errors_as_one_line():
            sys.argv += join_ranks()
            _hydra_main()
    finally:
        _spare_exit_collections()


def _compose_once() -> None:
    """Let Hydra compose the config once per run instead of twice.

    Before the run's composition, Hydra 1.3 composes the whole config once more only to read
    ``hydra.mode`` (``Hydra.get_mode``): 0.1-0.15 s, 2% of an MNIST run. Answering "not set"
    makes it take the mode from the command line (``-m``/``--multirun``, else a single run),
    as it does for every config that leaves ``hydra.mode`` unset, as trainkit's do. A
    ``hydra.mode`` override on the command line is still read Hydra's way. (A ``hydra.mode``
    set inside a config file is not: pass ``-m`` instead.)
    """
    from hydra._internal.hydra import Hydra

    original = getattr(Hydra, "get_mode", None)
    if original is None or getattr(original, "trainkit", False):  # another Hydra; done already
        return

    def get_mode(self: Any, config_name: str | None, overrides: list[str]) -> Any:
        if any(o.lstrip("+~").startswith("hydra.mode") for o in overrides):
            return original(self, config_name=config_name, overrides=overrides)
        return None

    get_mode.trainkit = True  # type: ignore[attr-defined]
    Hydra.get_mode = get_mode


def run() -> NoReturn:
    """``python -m trainkit.train`` and ``trainkit train``: :func:`main`, then end the process
    without the interpreter's teardown.

    Tearing the interpreter down (every module's objects freed one by one, torch's libraries
    unloaded) takes 0.2-0.3 s after a run, a thirtieth of an MNIST run. Nothing in it is needed
    once the run is over: the checkpoint, summary and logs are written and closed, and the exit
    handlers (logging's flush, torch's and your own ``atexit`` functions) still run. Where a
    thread that is not a daemon is still running (your own), the ordinary exit waits for it.
    """
    try:
        main()
        status = 0
    except SystemExit as stop:  # exit statuses of main(): 2 user error, 75 preempted, ...
        status = stop.code or 0
        if not isinstance(status, int):  # sys.exit("message"), as Python itself reports it
            print(status, file=sys.stderr)
            status = 1
    if any(not t.daemon for t in threading.enumerate() if t is not threading.current_thread()):
        sys.exit(status)
    atexit._run_exitfuncs()  # what the ordinary exit would run first (private, but stable)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (| head), a closed file
            stream.flush()
    os._exit(status)


def _spare_exit_collections() -> None:
    # At exit the interpreter runs full garbage collections while it tears the modules down,
    # each walking every object torch, Hydra and their imports made (hundreds of thousands):
    # 0.5-1 s of CPU, a tenth of an MNIST run. gc.freeze moves them out of the collector's
    # sight. Objects are still freed by reference counting as before; only reference cycles
    # left now would go uncollected, and no file depends on one: fit closes the TensorBoard
    # and metrics files and waits for the checkpoint writer in its finally, the summary is
    # written and closed, and log records are flushed as they are emitted.
    gc.freeze()


if __name__ == "__main__":
    run()
