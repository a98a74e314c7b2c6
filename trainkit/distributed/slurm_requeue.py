"""A SLURM job that requeues itself after its time-limit warning, and resumes where it stopped.

With ``#SBATCH --signal=B:USR1@120`` SLURM sends SIGUSR1 two minutes before the time limit. The
signal only sets the stop flag (:mod:`trainkit.core.signals`); the step in flight finishes, one
checkpoint is written, and then rank 0 runs ``scontrol requeue <job id>`` once
(:func:`requeue_after_stop`). The requeued job keeps its id, and the entry point's default run
directory is named after it (:func:`run_dir_name`), so it resumes from that checkpoint.

Only SIGUSR1 requeues: SIGTERM is what ``scancel`` sends, and a cancelled job must stay cancelled.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping

from trainkit.core.errors import TrainkitError, one_line

log = logging.getLogger("trainkit")


def job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The id ``scontrol`` knows this job by: ``<job>`` or, in an array, ``<array job>_<task>``;
    None outside SLURM.

    Raises:
        TrainkitError: an id that is not a number (say, a hand-set ``SLURM_ARRAY_TASK_ID=a``).

    Example:
        >>> job_id({"SLURM_JOB_ID": "108", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "8"})
        '100_8'
    """
    env = os.environ if environ is None else environ
    if "SLURM_JOB_ID" not in env:
        return None
    if "SLURM_ARRAY_JOB_ID" in env or "SLURM_ARRAY_TASK_ID" in env:
        names = ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID")
    else:
        names = ("SLURM_JOB_ID",)
    values = [env.get(name, "") for name in names]
    for name, value in zip(names, values):
        if not value.isdigit():
            raise TrainkitError(f"{name}={value!r} is not a number, so the job cannot be named "
                                "for its run dir or requeue: run under sbatch, which sets it, "
                                f"or unset {name}")
    return "_".join(values)


def run_dir_name(environ: Mapping[str, str] | None = None) -> str | None:
    """``slurm-<job id>`` (``slurm-<array job>_<task>`` in an array) under SLURM, else None:
    a requeued job, which keeps its id, finds its run directory again."""
    found = job_id(environ)
    return None if found is None else f"slurm-{found}"


# configs/train.yaml: hydra.run.dir is outputs/${oc.env:TRAINKIT_RUN_NAME,<date>/<time>}
RUN_NAME_ENV = "TRAINKIT_RUN_NAME"


def name_run_after_slurm_job() -> None:
    """Under SLURM, name the default run directory ``outputs/<run_dir_name()>`` instead of the
    time, so a requeued job starts in the folder it left and resumes; a ``TRAINKIT_RUN_NAME`` of
    your own, or a ``hydra.run.dir``, wins.

    Raises:
        TrainkitError: a SLURM job id that is not a number.
    """
    name = run_dir_name()
    if name is not None:
        os.environ.setdefault(RUN_NAME_ENV, name)


def requeue_after_stop(received: int | None, *, enabled: bool, is_main: bool) -> None:
    """After a stop's checkpoint: on rank 0 of a SLURM job warned by SIGUSR1, requeue the job.

    Says in one line what happened: requeued, or why not (no ``scontrol`` on the PATH, as in
    most containers; scontrol's own error, e.g. a job submitted with ``--no-requeue``). Either
    way the caller then exits 75 (:data:`~trainkit.core.signals.EXIT_PREEMPTED`).

    Args:
        received: the signal that stopped the run (None: stopped otherwise).
        enabled: ``trainer.slurm_requeue``.
        is_main: whether this is rank 0, the one rank that requeues.
    """
    if not (enabled and is_main and received == getattr(signal, "SIGUSR1", None)):
        return
    try:
        job = job_id()
    except TrainkitError as err:
        log.warning("not requeued: %s", err)
        return
    if job is None:
        return  # not under SLURM: SIGUSR1 from elsewhere
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        log.warning("not requeued: scontrol is not on the PATH (inside a container?); resubmit "
                    "the job, or run `scontrol requeue %s` outside, to resume", job)
        return
    try:
        done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True,
                              timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("not requeued: `scontrol requeue %s` failed: %s", job, one_line(err))
        return
    if done.returncode != 0:
        log.warning("not requeued: `scontrol requeue %s` exited %d: %s (submit with "
                    "#SBATCH --requeue)", job, done.returncode,
                    one_line(done.stderr or done.stdout or "no message", 200))
        return
    log.warning("requeued SLURM job %s: it resumes from this checkpoint when it starts again", job)
