"""The run directory Hydra makes before the job starts, taken back when the job never used it."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from trainkit.runtime import Runtime

# What Hydra writes into a run directory before the job's own code runs.
_HYDRA_ONLY = {".hydra"}


@contextlib.contextmanager
def removed_if_unused(run_dir: str | Path) -> Iterator[None]:
    """On an error, remove ``run_dir`` if it holds nothing but Hydra's ``.hydra/``.

    A config error is found inside the job, after Hydra has made ``outputs/<date>/<time>/``:
    without this each mistyped value left an empty-looking folder behind. A folder that holds
    anything else (a ``train.log``, checkpoints: any run that got as far as writing) is kept.
    Emptied parents inside Hydra's default ``outputs/`` go too (``outputs/<date>/``, then
    ``outputs/``); folders of your own naming, e.g. ``runs/`` of ``hydra.run.dir=runs/a``, stay.
    """
    try:
        yield
    except BaseException:
        # rank 0 alone: it writes the folder, and another rank's early error must not take it
        # away while rank 0 is about to use it
        if Runtime.from_env("cpu").is_main:
            _remove_unused(Path(run_dir).absolute())
        raise


def _remove_unused(run_dir: Path) -> None:
    try:
        if not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} - _HYDRA_ONLY:
            return
        shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
        run_dir.rmdir()
        outputs = Path.cwd() / "outputs"  # configs/train.yaml: outputs/<date>/<time>
        for parent in run_dir.parents:
            if not (parent == outputs or outputs in parent.parents) or any(parent.iterdir()):
                break
            parent.rmdir()
    except OSError:  # another rank removed it first, or a file appeared: leave what is there
        pass
