"""Under torchrun, the entry point's ranks agree on one run directory before Hydra starts."""

from __future__ import annotations

from trainkit.core.runtime import Runtime
from trainkit.distributed import group


def join_ranks() -> list[str]:
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
    if not group.connect_store(runtime):
        return []
    run_dir = group.published_run_dir()  # set when this is an elastic restart
    if run_dir is None and not runtime.is_main:
        run_dir = group.shared_run_dir()  # waits until rank 0's Hydra has made it
    overrides = [] if run_dir is None else [f"hydra.run.dir={_quoted(run_dir)}"]
    if not runtime.is_main:
        overrides.append("hydra.output_subdir=null")
    return overrides


def _quoted(value: str) -> str:
    """``value`` as a quoted Hydra override value (paths may hold spaces, '=' or ',')."""
    return "'" + value.replace("'", "\\'") + "'"
