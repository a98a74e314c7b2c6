"""``python -m trainkit.train +exp=mnist``: compose the config with Hydra, then train.

Only the entry point imports Hydra: this module, and its error folding
(:mod:`trainkit.entry.errors`) and rank joining (:mod:`trainkit.entry.ranks`).
``train(cfg, run_dir)`` reads top to bottom: settings -> runtime -> data -> model -> optimizer ->
trainer.fit -> summary.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from trainkit.checkpoint.adapters import check_adapters_only
from trainkit.config import TrainConfig
from trainkit.core.cuda_settings import use_device
from trainkit.core.errors import ConfigError
from trainkit.core.rng import seed_everything
from trainkit.core.runtime import Runtime
from trainkit.core.signals import EXIT_PREEMPTED, Preemption, stop_outside_training
from trainkit.distributed import group, slurm
from trainkit.distributed.slurm_requeue import requeue_after_stop
from trainkit.entry.config_dir import config_dir, schema
from trainkit.entry.errors import errors_as_one_line, set_resume_hint
from trainkit.entry.keys import check_known_keys
from trainkit.entry.own_data import build_data, save_classes, save_inputs
from trainkit.entry.ranks import join_ranks
from trainkit.entry.rebuild import build_criterion, build_forward, build_metrics
from trainkit.entry.run_dir import name_run_after_slurm_job, removed_if_unused, resume_command
from trainkit.entry.run_length import StartLines, length_notes
from trainkit.loop.trainer import Trainer
from trainkit.models.build import make_model
from trainkit.models.param_groups import build_optimizer
from trainkit.models.vision import for_channels
from trainkit.observe.flops import mfu_text
from trainkit.observe.logging import setup_logging

CONFIG_DIR = str(config_dir())
ConfigStore.instance().store(name="train_schema", node=schema())


def train(cfg: DictConfig, run_dir: str | Path, *, stop_at_step: int | None = None,
          resume: str | None = None) -> dict[str, Any]:
    """Run one training job described by a composed config; return its summary.

    ``stop_at_step`` stops after that step as a preemption would (for verify_resume).
    ``resume``: the command that resumes the run after a stop, where re-running this one would
    not (:func:`~trainkit.entry.run_dir.resume_command`); said at the start and at a stop.
    """
    check_known_keys(cfg)  # a +key=value of a typo: refused, not saved and ignored
    settings: TrainConfig = OmegaConf.to_object(cfg)  # type checks done; ranges checked here
    runtime = Runtime.from_env(settings.trainer.device)
    use_device(runtime.device)  # current before anything touches CUDA (also cuda:1 alone)
    group.init_process_group(runtime)  # backend by device: gloo for cpu, NCCL for cuda
    log = setup_logging(run_dir, runtime.is_main)
    # Experiment trackers and your own sinks, built first: a missing extra is said at once. They
    # start, and import their libraries, when training does (rank 0 only; docs/trackers.md).
    sinks = [instantiate(node, _convert_="all") for node in cfg.sinks.values() if node is not None]
    seed_everything(settings.trainer.seed)

    parts = build_parts(cfg, settings, runtime)
    save_classes(run_dir, parts.train_data, runtime)  # <run_dir>/classes.json, image data
    # Your callbacks: a `callbacks` node of name -> `_target_` (null drops one), on every rank.
    callbacks = [instantiate(node, _convert_="all")
                 for node in (cfg.get("callbacks") or {}).values() if node is not None]
    # after the run's first line: its folder, how it resumes, what changes its length
    callbacks.append(StartLines(
        [f"run dir {run_dir}" + (f"; after a stop, resume with: {resume}" if resume else "")],
        length_notes(settings.trainer, len(parts.train_data), cfg.sched) if runtime.is_main
        else []))
    for callback in callbacks:  # one that samples from the model (PrintSample) gets it
        if hasattr(callback, "set_model"):
            callback.set_model(parts.model)
    trainer = Trainer(settings.trainer, run_dir=run_dir, checkpoint=settings.checkpoint,
                      runtime=runtime, run_config=OmegaConf.to_container(cfg, resolve=True),
                      sinks=sinks, callbacks=callbacks)
    if resume:  # the stop line's "re-run the same command" would start a new run dir
        trainer.resume_hint = set_resume_hint(f"resume with: {resume}")
    scheduler = None
    if cfg.sched is not None:
        total_steps = trainer.planned_steps(len(parts.train_data))
        scheduler = instantiate(cfg.sched, optimizer=parts.optimizer, total_steps=total_steps)

    metrics = build_metrics(cfg, parts.num_classes)  # checked against the data's classes
    preemption = Preemption()  # which signal stopped the run: SLURM's warning requeues it
    # <run_dir>/inputs.json for export and predict: once the config has passed every check (a
    # run stopped by bad input leaves no folder)
    save_inputs(run_dir, cfg, settings, parts.train_data, runtime)
    summary = trainer.fit(
        parts.model, parts.optimizer, parts.train_data, criterion=parts.criterion,
        scheduler=scheduler, val_data=parts.val_data, metrics=metrics, stop_at_step=stop_at_step,
        forward=parts.forward, preemption=preemption,
    )
    if summary["status"] == "preempted":  # its checkpoint is written
        requeue_after_stop(preemption.received, enabled=settings.trainer.slurm_requeue,
                           is_main=runtime.is_main)
    if summary["status"] == "stopped":
        log.info("done: stopped at step %d (%s); run dir %s", summary["global_step"],
                 summary["stop_reason"], run_dir)
    if summary["status"] == "completed":
        log.info("done: %s after %d steps in %.1f s; %srun dir %s", final_result(cfg, summary),
                 summary["global_step"], summary["wall_time_s"],
                 f"{mfu_text(summary)}; " if "mfu" in summary else "", run_dir)
    return summary


def final_result(cfg: DictConfig, summary: dict[str, Any]) -> str:
    """The done line's result, named for the split it was measured on: MNIST's and CIFAR-10's
    evaluation is their test split; every other source's is a validation split."""
    metrics = summary["metrics"]
    if "val/acc" not in metrics:
        return f"val/loss {metrics.get('val/loss', float('nan')):.4f}"
    test = cfg.get("dataset") is None and cfg.data.name in ("mnist", "cifar10")
    return f"{'test' if test else 'validation'} accuracy {metrics['val/acc']:.4f}"


class RunParts(NamedTuple):
    """What a config builds for a run besides the Trainer (:func:`build_parts`)."""

    train_data: Any
    val_data: Any
    num_classes: int
    model: Any
    optimizer: Any
    criterion: Any
    forward: Any


def build_parts(cfg: DictConfig, settings: TrainConfig, runtime: Runtime) -> RunParts:
    """Data, model, optimizer and criterion as the config describes them, in that order.

    ``train`` and ``trainkit probe`` both build a run this way, so the probe measures what a
    run would train. Seed first (``seed_everything``) for the run's own initial weights.
    """
    train_data, val_data, num_classes = build_data(cfg, settings, runtime)
    with open_dict(cfg):  # a torchvision classifier's stem for grayscale data (recorded so)
        cfg.model = for_channels(cfg.model, settings.data.channels)
    # model.pretrained's weights (before DDP/FSDP and compile; a resumed run's checkpoint wins),
    # then model.lora's adapters
    model = make_model(cfg.model, pretrained=True)
    if settings.checkpoint.adapters_only:  # refused now, not once the run has begun
        check_adapters_only(model, sharded=settings.trainer.strategy == "fsdp")
    # optim.param_groups, layer_decay, decay_norm_and_bias: the groups; the rest its _target_'s
    optimizer = build_optimizer(model, OmegaConf.to_container(cfg.optim, resolve=True),
                                lambda node, groups: instantiate(node, params=groups,
                                                                 _convert_="all"))
    criterion = build_criterion(cfg)  # the config's (e.g. label smoothing), or cross-entropy
    forward = build_forward(cfg)  # the config's (a language model's lm_forward), or the default
    vocab = getattr(model, "vocab_size", None)
    if isinstance(vocab, int) and isinstance(num_classes, int) and vocab < num_classes:
        raise ConfigError(f"model.vocab_size={vocab} but the data's tokens go up to "
                          f"{num_classes}: set model.vocab_size={num_classes}")
    return RunParts(train_data, val_data, num_classes, model, optimizer, criterion, forward)


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    # Errors are reported here, inside the job: past this point Hydra would add its own lines.
    with errors_as_one_line():
        slurm.export_torch_env()  # a job of Hydra's submitit launcher: its tasks are the ranks
        # Under torchrun rank 0 tells the others (waiting in join_ranks) its folder; theirs is
        # that one already, and an elastic restart's is the first attempt's: all get the same.
        run_dir = group.shared_run_dir(HydraConfig.get().runtime.output_dir)
        with removed_if_unused(run_dir):  # a config error leaves no folder of Hydra's files only
            summary = train(cfg, run_dir, resume=resume_command(run_dir))
    group.shutdown()
    if summary["status"] == "preempted":
        sys.exit(EXIT_PREEMPTED)  # documented: checkpoint saved; the stop line says how to resume


def main() -> None:
    """Run the Hydra app; user errors print as one line and exit with status 2."""
    stop_outside_training()  # a signal before the first step: one line and exit 75, not death
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let composition errors reach us unprinted
    with errors_as_one_line():
        slurm.export_torch_env()  # srun without torchrun: ranks and master from SLURM's variables
        name_run_after_slurm_job()  # under SLURM: outputs/slurm-<job id>, found again on requeue
        sys.argv += join_ranks()
        _hydra_main()


if __name__ == "__main__":
    main()
