"""The run directory Hydra makes before the job starts: taken back when the job never used it,
marked ``failed`` when it did and then failed."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from trainkit.core.errors import TrainkitError, command_name, one_line
from trainkit.core.runtime import Runtime
from trainkit.distributed.slurm_requeue import run_dir_name
from trainkit.entry.errors import hydra_words
from trainkit.observe.summary import read_summary, write_summary

# What Hydra writes into a run directory before the job's own code runs.
_HYDRA_ONLY = {".hydra"}
# Bad input: ours, or a config node Hydra could not build (an optimizer's misspelt _target_).
_BAD_INPUT = (TrainkitError, HydraException, OmegaConfBaseException)


@contextlib.contextmanager
def removed_if_unused(run_dir: str | Path) -> Iterator[None]:
    """On an error, remove ``run_dir`` if it holds nothing but Hydra's ``.hydra/`` -- or, after
    bad input (a :class:`TrainkitError`, or a config Hydra could not build), also this run's own
    ``train.log``, its ``inputs.json`` and empty folders.

    A config error is found inside the job, after Hydra has made ``outputs/<date>/<time>/``:
    without this each mistyped value left an empty-looking folder behind; so did an error found
    as the run starts (a checkpoint that does not fit, data that cannot be downloaded), whose
    lines the console has. A folder that holds anything else (a ``train.log`` of an earlier
    attempt, checkpoints, metrics: any run that got as far as training) is kept. Emptied parents
    inside Hydra's default ``outputs/`` go too (``outputs/<date>/``, then ``outputs/``); folders
    of your own naming, e.g. ``runs/`` of ``hydra.run.dir=runs/a``, stay. A folder kept after
    an error that wrote no summary gets one that says ``failed`` and why (:func:`_mark_failed`).
    """
    run_dir = Path(run_dir).absolute()
    # this attempt's own files (not an earlier attempt's): gone with its bad input
    ours = {name for name in ("train.log", "inputs.json") if not (run_dir / name).exists()}
    summary = read_summary(run_dir)
    try:
        yield
    except BaseException as err:
        # rank 0 alone: it writes the folder, and another rank's early error must not take it
        # away while rank 0 is about to use it
        if Runtime.from_env("cpu").is_main:
            _remove_unused(run_dir, _HYDRA_ONLY | (ours if isinstance(err, _BAD_INPUT) else set()))
            if (run_dir.is_dir() and summary is None and read_summary(run_dir) is None
                    and isinstance(err, Exception)):  # not a stop, an abort or an exit
                _mark_failed(run_dir, err)
        raise


def _mark_failed(run_dir: Path, err: Exception) -> None:
    """``summary.json`` of a run that failed before it had one (the loop writes ``diverged``,
    ``oom``, ``hung`` itself; an earlier attempt's summary stays): ``status: failed`` and the
    error's line, which ``trainkit runs`` shows. A later attempt's summary replaces it."""
    error = (hydra_words(str(err)) if isinstance(err, TrainkitError)
             else f"{type(err).__name__}: {one_line(err)}")
    with contextlib.suppress(OSError):
        write_summary(run_dir, {"status": "failed", "error": error})


def _remove_unused(run_dir: Path, unused: set[str]) -> None:
    try:
        if not run_dir.is_dir():
            return
        entries = list(run_dir.iterdir())
        if any(p.name not in unused and not (p.is_dir() and not any(p.iterdir()))
               for p in entries):
            return  # something of the run's own: keep it all
        for path in entries:
            if path.name == ".hydra":
                shutil.rmtree(path, ignore_errors=True)
            elif path.is_dir():
                path.rmdir()  # empty (checkpoints/ made before the error)
            else:
                path.unlink()
        run_dir.rmdir()
        outputs = Path.cwd() / "outputs"  # configs/train.yaml: outputs/<date>/<time>
        for parent in run_dir.parents:
            if not (parent == outputs or outputs in parent.parents) or any(parent.iterdir()):
                break
            parent.rmdir()
    except OSError:  # another rank removed it first, or a file appeared: leave what is there
        pass


# configs/train.yaml: hydra.run.dir is outputs/${oc.env:TRAINKIT_RUN_NAME,<date>/<time>}
RUN_NAME_ENV = "TRAINKIT_RUN_NAME"


def name_run_after_slurm_job() -> None:
    """Under SLURM, name the default run directory ``outputs/slurm-<job id>`` (array tasks
    ``slurm-<array job>_<task>``) instead of the time: a requeued job keeps its id, so it starts
    in the run directory it left and resumes from its checkpoint. A ``TRAINKIT_RUN_NAME`` of your
    own, or a ``hydra.run.dir``, wins.

    Raises:
        TrainkitError: a SLURM job id that is not a number.
    """
    name = run_dir_name()
    if name is not None:
        os.environ.setdefault(RUN_NAME_ENV, name)


# Hydra overrides a resume command leaves out: the folder (it names its own), and what only a
# multirun or another rank's start needs.
_NOT_CARRIED = ("hydra.run.dir", "hydra.sweep.", "hydra.mode", "hydra.job.num", "hydra.job.id",
                "hydra.output_subdir", "hydra/launcher", "hydra/sweeper")


def resume_command(run_dir: str | Path) -> str | None:
    """The command that resumes this run in ``run_dir``; None where re-running the same command
    does (``hydra.run.dir`` given, or the folder named by ``TRAINKIT_RUN_NAME``, as under SLURM).

    Hydra's default folder is new at every start (``outputs/<date>/<time>``), and so is a
    multirun's: their resume command is the job's own overrides (Hydra's record of them) with
    ``hydra.run.dir=<run_dir>``, started as this process was (``trainkit train``, ``python -m
    trainkit.train``, under torchrun).
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra = HydraConfig.get()
    given = list(hydra.overrides.hydra)
    fixed = RUN_NAME_ENV in os.environ or any(o.startswith("hydra.run.dir=") for o in given)
    if hydra.mode == RunMode.RUN and fixed:
        return None
    kept = [o for o in given if not o.lstrip("+~").startswith(_NOT_CARRIED)]
    overrides = [*hydra.overrides.task, *kept, f"hydra.run.dir={run_dir}"]
    return " ".join([_program(), *map(shlex.quote, overrides)])


def _program() -> str:
    """How this process was started: ``trainkit train`` or ``python -m trainkit.train``, after
    torchrun's options where torchrun started it."""
    program = command_name("trainkit.train")
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return program
    local, world = os.environ.get("LOCAL_WORLD_SIZE", "1"), os.environ.get("WORLD_SIZE", "1")
    nodes = "" if local == world else "--nnodes=<nodes> <your rendezvous options> "
    module = (f"--no-python {program}" if program.startswith("trainkit")
              else program.removeprefix("python "))
    return f"torchrun {nodes}--nproc_per_node={local} {module}"
