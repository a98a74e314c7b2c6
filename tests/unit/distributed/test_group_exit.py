"""The process group trainkit joined is left at a normal exit, not after an unhandled exception
(that process exits at once: torchrun tears the job down). The registration by
init_process_group and the 2-rank exit run under torchrun in tests/dist/test_micro_batch.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, offline_env

# an atexit hook registered before trainkit's runs after it: it sees whether the group is up
SCRIPT = """
import atexit, sys
import torch.distributed as dist
atexit.register(lambda: open(sys.argv[1], "w").write(str(dist.is_initialized())))
from trainkit.distributed import group
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
atexit.register(group.leave_at_exit)
if sys.argv[2] == "crash":
    raise RuntimeError("an unhandled error")
"""


@pytest.mark.parametrize(("end", "up_at_exit", "status"), [("normal", "False", 0),
                                                         ("crash", "True", 1)])
def test_the_group_is_left_at_a_normal_exit_only(tmp_path: Path, end: str, up_at_exit: str,
                                                 status: int) -> None:
    record = tmp_path / "up.txt"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(record), end], cwd=REPO,
                          env=offline_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == status, proc.stderr[-2000:]
    assert record.read_text() == up_at_exit
