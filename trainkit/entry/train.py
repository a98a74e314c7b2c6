"""``python -m trainkit.train +exp=mnist``: compose the config with Hydra, then train.

``train(cfg, run_dir)`` reads top to bottom: settings (the typed config, built once) -> runtime
-> the run's parts (data, model, optimizer: :mod:`trainkit.entry.build`) -> trainer.fit ->
summary. The library never imports Hydra; the commands in :mod:`trainkit.entry` do.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from trainkit.core.cuda_settings import use_device
from trainkit.core.rng import seed_everything
from trainkit.core.runtime import Runtime
from trainkit.core.schema import config_dir, schema
from trainkit.core.signals import EXIT_PREEMPTED, Preemption, stop_outside_training
from trainkit.data import source_of
from trainkit.distributed import group, slurm
from trainkit.distributed.ranks import join_ranks
from trainkit.distributed.slurm_requeue import name_run_after_slurm_job, requeue_after_stop
from trainkit.entry.build import (
    build_callbacks,
    build_metrics,
    build_parts,
    build_scheduler,
    build_settings,
    build_sinks,
    run_record,
    save_run_files,
)
from trainkit.entry.errors import errors_as_one_line, set_resume_hint
from trainkit.entry.run_dir import RunRecords, removed_if_unused, resume_command
from trainkit.loop.run_length import StartLines, length_notes
from trainkit.loop.trainer import Trainer
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
    settings = build_settings(cfg)  # the typed config, once: keys, types and ranges checked
    runtime = Runtime.from_env(settings.trainer.device)
    use_device(runtime.device)  # current before anything touches CUDA (also cuda:1 alone)
    group.init_process_group(runtime)  # backend by device: gloo for cpu, NCCL for cuda
    log = setup_logging(run_dir, runtime.is_main)
    sinks = build_sinks(cfg)  # first: a tracker's missing extra is said at once
    seed_everything(settings.trainer.seed)

    parts = build_parts(cfg, settings, runtime)  # the data's class count read first
    # after the run's first line: its folder, how it resumes, what changes its length
    start = StartLines(
        [f"run dir {run_dir}" + (f"; after a stop, resume with: {resume}" if resume else "")],
        length_notes(settings.trainer, len(parts.train_data), cfg.sched) if runtime.is_main
        else [])
    # the run's records (.hydra/, classes.json, inputs.json): once training starts, after its
    # checkpoint was found to fit -- a refused start leaves an earlier run's folder as it was
    records = RunRecords(run_dir, cfg, lambda: save_run_files(run_dir, cfg, settings, parts,
                                                              runtime))
    trainer = Trainer(settings.trainer, run_dir=run_dir, checkpoint=settings.checkpoint,
                      runtime=runtime,
                      run_config=run_record(cfg, parts.num_classes, settings.data.channels),
                      sinks=sinks,
                      callbacks=[records, *build_callbacks(cfg, parts.model), start])
    if resume:  # the stop line's "re-run the same command" would start a new run dir
        trainer.resume_hint = set_resume_hint(f"resume with: {resume}")
    scheduler = build_scheduler(cfg, parts.optimizer,
                                trainer.planned_steps(len(parts.train_data)))
    metrics = build_metrics(cfg, parts.num_classes)  # checked against the data's classes
    preemption = Preemption()  # which signal stopped the run: SLURM's warning requeues it
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
    test = cfg.get("dataset") is None and source_of(cfg.data.name).eval_split == "test"
    return f"{'test' if test else 'validation'} accuracy {metrics['val/acc']:.4f}"


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    # Errors are reported here, inside the job: past this point Hydra would add its own lines.
    with errors_as_one_line():
        slurm.export_torch_env()  # a job of Hydra's submitit launcher: its tasks are the ranks
        # Under torchrun rank 0 tells the others (waiting in join_ranks) its folder; theirs is
        # that one already, and an elastic restart's is the first attempt's: all get the same.
        run_dir = group.shared_run_dir(HydraConfig.get().runtime.output_dir)
        with removed_if_unused(run_dir, cfg):  # a config error leaves no empty new folder
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
