"""examples/quickstart.ipynb executed in a real Jupyter kernel, and interrupted the way the stop
button interrupts it (the kernel manager's SIGINT)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat import NotebookNode

from tests.conftest import REPO, last_checkpoint, offline_env
from tests.helpers.fakes import write_fake_mnist

EXAMPLES = REPO / "examples"
NOTEBOOK = EXAMPLES / "quickstart.ipynb"
WIDGET = "application/vnd.jupyter.widget-view+json"
# The kernel's own checks, run after the notebook: signal handlers as the kernel had them before
# (torch's launch agent replaces four), and trainkit's log handlers.
SIGNALS_BEFORE = ("import logging, signal\n"
                  "_handlers = {s: signal.getsignal(s) for s in signal.valid_signals()}")
STATE_AFTER = ("print('changed signals:', sorted(signal.Signals(s).name for s, h in "
               "_handlers.items() if signal.getsignal(s) is not h))\n"
               "print('SIGINT raises KeyboardInterrupt:', "
               "signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
               "print('log handlers:', [type(h).__name__ for h in "
               "logging.getLogger('trainkit').handlers])")


def _notebook(prelude: str, **params: object) -> NotebookNode:
    """The notebook with ``prelude`` and ``params`` in a cell after its parameters cell, as
    papermill injects them."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    at = next(i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", []))
    source = "\n".join([prelude, *(f"{key} = {value!r}" for key, value in params.items())])
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(
        source, metadata={"tags": ["injected-parameters"]}))
    return nb


def _index(nb: NotebookNode, text: str) -> int:
    """The first code cell whose source contains ``text``."""
    return next(i for i, cell in enumerate(nb.cells)
                if cell.cell_type == "code" and text in cell.source)


def _text(cell: NotebookNode) -> str:
    """What a cell printed and returned, as text."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            parts.append(output.data.get("text/plain", ""))
        elif output.output_type == "error":
            parts.append(f"{output.ename}: {output.evalue}")
    return "".join(parts)


def _widgets(cell: NotebookNode) -> int:
    return sum(WIDGET in output.get("data", {}) for output in cell.get("outputs", []))


class Kernel:
    """One real kernel running a notebook's cells one at a time (nbclient), cwd examples/."""

    def __init__(self, client: NotebookClient) -> None:
        self.client, self.nb = client, client.nb

    def run(self, index: int) -> NotebookNode:
        return self.client.execute_cell(self.nb.cells[index], index)

    def run_code(self, source: str) -> NotebookNode:
        """Run code of the test's own in the notebook's kernel."""
        self.nb.cells.append(nbformat.v4.new_code_cell(source))
        return self.run(len(self.nb.cells) - 1)

    def interrupt_when(self, *conditions: Callable[[], bool], timeout: float = 120) -> None:
        """In the background: for each condition in turn, wait until it holds, then interrupt
        the kernel as Jupyter's stop button does (KernelManager.interrupt_kernel: SIGINT)."""
        def interrupts() -> None:
            for condition in conditions:
                deadline = time.monotonic() + timeout
                while not condition() and time.monotonic() < deadline:
                    time.sleep(0.02)
                asyncio.run(self.client.km.interrupt_kernel())
        threading.Thread(target=interrupts, daemon=True).start()


@pytest.fixture
def kernel_for(tmp_path: Path) -> Iterator[Callable[[NotebookNode], Kernel]]:
    clients: list[NotebookClient] = []
    contexts = []

    def start(nb: NotebookNode) -> Kernel:
        client = NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": str(EXAMPLES)}})
        context = client.setup_kernel(env=offline_env(CUDA_VISIBLE_DEVICES=""))
        context.__enter__()
        clients.append(client)
        contexts.append(context)
        return Kernel(client)

    yield start
    for context in contexts:
        context.__exit__(None, None, None)


def _logged(path: Path, pattern: str) -> Callable[[], bool]:
    return lambda: path.is_file() and re.search(pattern, path.read_text()) is not None


@pytest.mark.slow
def test_quickstart_runs_top_to_bottom_and_a_rerun_resumes(tmp_path: Path, kernel_for) -> None:
    root = write_fake_mnist(tmp_path / "data", n_train=1024, n_test=256)
    run_dir = tmp_path / "run"
    nb = _notebook(SIGNALS_BEFORE, DATA_ROOT=str(root), VERIFY=False, RUN_DIR=str(run_dir),
                   LOG_EVERY_N_STEPS=2, DDP_STEPS=3)
    kernel = kernel_for(nb)
    for index in range(len(nb.cells)):
        cell = kernel.run(index)
        assert not [o for o in cell.get("outputs", []) if o.output_type == "error"], _text(cell)
    train = _index(nb, "trainer.fit(")
    first = nb.cells[train]
    assert "status: completed, step 8," in _text(first)
    assert _widgets(first) == 1, "no notebook progress bar in a kernel with ipywidgets"
    assert _text(first).count("training MnistNet") == 1
    assert "'status': 'completed'" in _text(nb.cells[_index(nb, "saved = json.loads")])
    assert "train/loss at 4 steps" in _text(nb.cells[_index(nb, "EventAccumulator")])
    ddp = _text(nb.cells[_index(nb, "launch(")])
    assert "rank 0: completed at step 3, world size 2" in ddp
    assert "rank 1: completed at step 3, world size 2" in ddp

    again = _text(kernel.run(train))  # re-running the cell: the finished run reports again
    assert again.count("resumed from") == 1 and "training MnistNet" not in again
    assert "the run is complete at step 8 of 8" in again  # and trains nor evaluates again
    assert "status: completed, step 8," in again
    log = (run_dir / "train.log").read_text()
    assert log.count("training MnistNet") == 1 and log.count("resumed from") == 1
    assert "rank" not in log and not (run_dir.parent / "train.log").exists()
    state = _text(kernel.run_code(STATE_AFTER))
    assert "changed signals: []" in state
    assert "SIGINT raises KeyboardInterrupt: True" in state
    assert "log handlers: ['ConsoleHandler', 'FileHandler']" in state


@pytest.mark.slow
def test_interrupting_the_kernel_preempts_fit_and_the_kernel_lives_on(
        tmp_path: Path, kernel_for) -> None:
    root = write_fake_mnist(tmp_path / "data", n_train=1024, n_test=256)
    run_dir = tmp_path / "run"
    # Without ipywidgets (an import of None fails): the progress shows as plain log lines.
    nb = _notebook(SIGNALS_BEFORE + "\nimport sys\nsys.modules['ipywidgets'] = None",
                   DATA_ROOT=str(root), VERIFY=False, RUN_DIR=str(run_dir),
                   MAX_EPOCHS=10**6, LOG_EVERY_N_STEPS=1)
    kernel = kernel_for(nb)
    train = _index(nb, "trainer.fit(")
    for index in range(train):
        kernel.run(index)

    # Once: the step finishes, one checkpoint, fit returns "preempted".
    kernel.interrupt_when(_logged(run_dir / "train.log", r"step 3/"))
    stopped = _text(kernel.run(train))
    assert "received SIGINT: finishing this step" in stopped
    step = int(re.search(r"status: preempted, step (\d+),", stopped).group(1))
    assert last_checkpoint(run_dir)["global_step"] == step
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "preempted"
    assert _widgets(nb.cells[train]) == 0 and f"step {step}/" in stopped

    # The kernel is alive, its SIGINT handling as before; re-running the cell resumes.
    kernel.run_code(f"MAX_EPOCHS, MAX_STEPS = 1, {step + 2}")
    resumed = _text(kernel.run(train))
    assert f"resumed from {run_dir / 'checkpoints'}" in resumed and f"at step {step} " in resumed
    assert f"status: completed, step {step + 2}," in resumed

    # Twice: the second interrupt aborts the step in flight without saving. From step 2 on a
    # step lasts until an interrupt ends it (a sleep that ends only by the test's deadline): the
    # second interrupt lands inside it however late it comes.
    abort_log = tmp_path / "abort" / "train.log"
    kernel.interrupt_when(_logged(abort_log, r"step 1/"), _logged(abort_log, "received SIGINT"))
    aborted = kernel.run_code(
        "import time\n"
        "from trainkit.loop.step import default_forward\n"
        "forwards = []\n"
        "def slow_forward(model, batch):\n"
        "    forwards.append(1)\n"
        "    if len(forwards) > 1:\n"
        "        time.sleep(600)\n"
        "    return default_forward(model, batch)\n"
        f"aborting = Trainer(TrainerConfig(max_steps=50, log_every_n_steps=1), "
        f"run_dir={str(tmp_path / 'abort')!r})\n"
        "aborting.fit(model, optimizer, train_loader, forward=slow_forward)")
    assert [o.ename for o in aborted.outputs if o.output_type == "error"] == ["KeyboardInterrupt"]
    assert "second signal (SIGINT): aborting without saving" in _text(aborted)
    assert not (tmp_path / "abort" / "checkpoints" / "last.pt").exists()
    assert not (tmp_path / "abort" / "summary.json").exists()

    state = _text(kernel.run_code(STATE_AFTER))
    assert "SIGINT raises KeyboardInterrupt: True" in state
    assert "log handlers: ['ConsoleHandler', 'FileHandler']" in state
