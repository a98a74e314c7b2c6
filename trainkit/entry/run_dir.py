"""The run directory: its records written once the run is accepted, taken back when a start
leaves it unused, marked ``failed`` when a new run failed, and the command that resumes it.

Hydra writes nothing into it (``hydra.output_subdir: null`` in ``configs/train.yaml``): a start
refused by its config, its data or its checkpoint leaves an existing run's folder as it was.
The records Hydra would have written first (``.hydra/config.yaml``, ``hydra.yaml``,
``overrides.yaml``) are written here, from Hydra's public config, once training starts.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainkit.core.errors import TrainkitError, one_line
from trainkit.core.runtime import Runtime
from trainkit.distributed.slurm_requeue import RUN_NAME_ENV
from trainkit.entry.errors import hydra_words
from trainkit.observe.summary import read_summary, write_summary

# Where the records go: the folder Hydra itself uses.
RECORDS = ".hydra"


def write_records(run_dir: str | Path, cfg: DictConfig) -> None:
    """``.hydra/config.yaml`` (the job's config), ``hydra.yaml`` and ``overrides.yaml``, as Hydra
    writes them, unless Hydra wrote them itself (a user's ``hydra.output_subdir=...``) or this is
    no Hydra job (``train(cfg, run_dir)`` called with a composed config, as verify_resume does)."""
    if not HydraConfig.initialized():
        return
    hydra = HydraConfig.get()
    if hydra.output_subdir is not None:
        return
    folder = Path(run_dir) / RECORDS
    folder.mkdir(parents=True, exist_ok=True)
    records: dict[str, Any] = {"config.yaml": cfg,
                               "hydra.yaml": OmegaConf.create({"hydra": hydra}),
                               "overrides.yaml": hydra.overrides.task}
    for name, node in records.items():
        (folder / name).write_text(OmegaConf.to_yaml(node))


class RunRecords:
    """A callback writing the run's records as training starts (after the checkpoint it resumes
    from was found to fit): ``.hydra/`` and whatever ``write`` adds (class names, inputs)."""

    def __init__(self, run_dir: str | Path, cfg: DictConfig, write: Any = None) -> None:
        self.run_dir, self.cfg, self.write = run_dir, cfg, write

    def on_fit_start(self, trainer: Any) -> None:
        _accepted.add(Path(self.run_dir).absolute())
        if trainer.runtime.is_main:
            write_records(self.run_dir, self.cfg)
            if self.write is not None:
                self.write()


# The run folders of this process whose run was accepted (training started there).
_accepted: set[Path] = set()
# What this package writes into a run directory only with its records.
_HYDRA_ONLY = {RECORDS}
# Bad input: ours, or a config node Hydra could not build (an optimizer's misspelt _target_).
_BAD_INPUT = (TrainkitError, HydraException, OmegaConfBaseException)


@contextlib.contextmanager
def removed_if_unused(run_dir: str | Path, cfg: DictConfig | None = None) -> Iterator[None]:
    """On an error before the run was accepted, leave a folder that held an earlier run as it
    was. Otherwise remove the folder if it holds nothing but empty folders -- after bad input
    also this attempt's own ``train.log`` and ``inputs.json`` -- so a typo leaves no
    empty-looking ``outputs/<date>/<time>/`` (emptied parents inside ``outputs/`` go too); a
    folder that holds anything else is kept and, without an earlier attempt's summary, marked
    ``failed`` with the error's line (:func:`_mark_failed`), with ``cfg``'s records."""
    run_dir = Path(run_dir).absolute()
    # an earlier run's folder: a start that fails before it is accepted changes nothing there
    earlier = run_dir.is_dir() and any(p.name != RECORDS for p in run_dir.iterdir())
    summary = read_summary(run_dir)  # an earlier attempt's summary stays
    try:
        yield
    except BaseException as err:
        # rank 0 alone: it writes the folder, and another rank's early error must not take it
        # away while rank 0 is about to use it
        if Runtime.from_env("cpu").is_main and (run_dir in _accepted or not earlier):
            mine = {"train.log", "inputs.json"} if isinstance(err, _BAD_INPUT) else set()
            _remove_unused(run_dir, _HYDRA_ONLY | mine)
            if (run_dir.is_dir() and summary is None and read_summary(run_dir) is None
                    and isinstance(err, Exception)):  # not a stop, an abort or an exit
                _mark_failed(run_dir, err, cfg)
        raise


def _mark_failed(run_dir: Path, err: Exception, cfg: DictConfig | None) -> None:
    """``summary.json`` of a new run that failed before it had one (the loop writes
    ``diverged``, ``oom``, ``hung`` itself): ``status: failed`` and the error's line, which
    ``trainkit runs`` shows (it lists the folders with records). A later attempt's summary
    replaces it."""
    error = (hydra_words(str(err)) if isinstance(err, TrainkitError)
             else f"{type(err).__name__}: {one_line(err)}")
    with contextlib.suppress(OSError):
        write_summary(run_dir, {"status": "failed", "error": error})
        if cfg is not None and not (run_dir / RECORDS / "config.yaml").exists():
            write_records(run_dir, cfg)


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
    hydra = HydraConfig.get()
    given = list(hydra.overrides.hydra)
    fixed = RUN_NAME_ENV in os.environ or any(o.startswith("hydra.run.dir=") for o in given)
    if hydra.mode == RunMode.RUN and fixed:
        return None
    kept = [o for o in given if not o.lstrip("+~").startswith(_NOT_CARRIED)]
    overrides = [*hydra.overrides.task, *kept, f"hydra.run.dir={run_dir}"]
    return " ".join([_program(), *map(shlex.quote, overrides)])


def _program() -> str:
    """How this process was started, as a command that runs as typed in a shell without this
    environment's ``bin/`` on its PATH: this interpreter's full path with ``-m trainkit.train``
    (``trainkit train`` where that is the console command on the PATH), after torchrun's options
    (``-m torch.distributed.run``) where torchrun started it."""
    python = shlex.quote(sys.executable)
    console = sys.argv[0].startswith("trainkit ")
    on_path = shutil.which("trainkit")
    if console and on_path and Path(on_path) == Path(sys.executable).parent / "trainkit":
        module = "--no-python trainkit train"
        program = "trainkit train"
    else:
        module = "-m trainkit train" if console else "-m trainkit.train"
        program = f"{python} {module}"
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return program
    local, world = os.environ.get("LOCAL_WORLD_SIZE", "1"), os.environ.get("WORLD_SIZE", "1")
    nodes = "" if local == world else "--nnodes=<nodes> <your rendezvous options> "
    return f"{python} -m torch.distributed.run {nodes}--nproc_per_node={local} {module}"
