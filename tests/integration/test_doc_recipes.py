"""Shell recipes of the docs, taken from the docs' own text and run in a shell as written.

Only what a CPU can run changes: the fake data and a few steps are appended to the command, and
a shell function stands in for `python` where a recipe's logic, not training, is under test.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, offline_env

LONG_RUNNING = REPO / "docs" / "long-running-jobs.md"


def bash_block(doc: Path, marker: str) -> str:
    """The one recipe of ``doc`` that contains ``marker``: a ```bash block, or the paragraph of
    one (its recipes are separated by blank lines)."""
    blocks = re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S)
    found = [p for b in blocks for p in b.split("\n\n") if marker in p]
    assert len(found) == 1, f"{len(found)} recipes of {doc.name} contain {marker!r}"
    return found[0]


def retry_loop(marker: str) -> str:
    """The docs' retry loop (``until ...; do ... done``) from the block that holds ``marker``."""
    block = bash_block(LONG_RUNNING, marker)
    loop = re.search(r"^until .*?^done$", block, re.S | re.M)
    assert loop, block
    return loop.group(0)


# `python` as a shell function: each call is one "run" that exits with the next status listed.
FAKE_RUNS = '''statuses=({statuses}); runs=0
python() {{ runs=$((runs + 1)); echo "run $runs"; return ${{statuses[runs - 1]}}; }}
'''


def run_loop(loop: str, statuses: list[int], *shell_flags: str) -> tuple[int, int]:
    """Run ``loop`` as the end of a job script; return its exit status and how many runs."""
    script = FAKE_RUNS.format(statuses=" ".join(map(str, statuses))) + loop + "\n"
    proc = subprocess.run(["bash", *shell_flags, "-c", script], capture_output=True, text=True,
                          timeout=60)
    return proc.returncode, proc.stdout.count("run ")


@pytest.mark.parametrize("flags", [(), ("-e",)], ids=["plain", "set-e"])
def test_retry_loop_passes_on_a_real_error(flags: tuple[str, ...]) -> None:
    loop = retry_loop("hydra.run.dir=runs/cifar; do")
    assert run_loop(loop, [75, 75, 3], *flags) == (3, 3)  # resumed twice, then the error's 3
    assert run_loop(loop, [1], *flags) == (1, 1)
    assert run_loop(loop, [75, 0], *flags) == (0, 2)  # preempted, resumed, completed
    assert run_loop(loop, [0], *flags) == (0, 1)


def test_hang_retry_loop_passes_on_a_real_error() -> None:
    loop = retry_loop("trainer.hang_action=abort; do")
    assert run_loop(loop, [124, 75, 2]) == (2, 3)  # hung, preempted, then an error
    assert run_loop(loop, [124, 0]) == (0, 2)


def test_retry_loop_in_parentheses_keeps_the_prompt() -> None:
    """What the doc says to type at a prompt: the shell survives and $? is the error's."""
    loop = retry_loop("hydra.run.dir=runs/cifar; do")
    script = FAKE_RUNS.format(statuses="75 3") + f"( {loop} )\necho \"after $?\"\n"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines()[-1] == "after 3", proc.stdout


@pytest.mark.slow
def test_nohup_recipe_on_a_fresh_folder(tmp_path: Path, mnist_root: Path) -> None:
    """The nohup block, from a folder without runs/: the output file can be made, and tail
    follows train.log although the run creates it only after tail has started."""
    block = bash_block(LONG_RUNNING, "nohup python")
    fast = (f"hydra.run.dir=runs/mnist data.root={mnist_root} data.verify=false "
            "data.download=false data.batch_size=64 trainer.max_steps=6 "
            "trainer.log_every_n_steps=2")
    script = block.replace("hydra.run.dir=runs/mnist", fast, 1)
    assert script != block
    env = offline_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env["PYTHONPATH"] = str(REPO)  # this checkout's trainkit, also where it is not installed
    shell = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    followed = b""
    deadline = time.monotonic() + 300
    try:  # tail's output; `tail -f` would end at once, before the run has made its log
        while b"done: test accuracy" not in followed:
            if not select.select([shell.stdout], [], [], deadline - time.monotonic())[0]:
                break  # the run failed (its reason is in runs/mnist.out) or is far too slow
            chunk = os.read(shell.stdout.fileno(), 1 << 16)
            if not chunk:
                break  # tail ended
            followed += chunk
    finally:
        os.killpg(shell.pid, signal.SIGKILL)  # tail follows forever
        shell.wait()
    out = tmp_path / "runs" / "mnist.out"
    text = followed.decode()
    assert "done: test accuracy" in text, (
        text + (out.read_text() if out.is_file() else "(no runs/mnist.out)"))
    assert " step 6/6 " in text, text
    assert (tmp_path / "runs" / "mnist" / "summary.json").is_file()
    assert "training " in out.read_text()
