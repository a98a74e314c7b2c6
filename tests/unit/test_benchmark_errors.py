"""A benchmark whose torchrun job fails says why: the worker's error, not torchrun's banner."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.common import run_process


@pytest.mark.parametrize(("body", "expected"), [
    ("raise RuntimeError('the shard is missing')", "RuntimeError: the shard is missing"),
    ("import os; os.abort()", "exitcode : -6"),
])
def test_a_failed_torchrun_job_names_its_workers_error(tmp_path: Path, body: str,
                                                        expected: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(body + "\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=1", str(script)]
    with pytest.raises(SystemExit) as failed:
        run_process(command)
    message = str(failed.value)
    assert message.startswith("-m torch.distributed.run --standalone failed (exit 1): "), message
    assert expected in message, message
