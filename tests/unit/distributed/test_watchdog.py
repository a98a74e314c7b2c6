"""The hang watchdog in one process: real threads, real stalls (short ones), real files."""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore
from torch.utils.data import DataLoader, Dataset

from trainkit import CheckpointConfig, ConfigError, Trainer, TrainerConfig
from trainkit.distributed.heartbeats import Board, behind_ranks, hang_line
from trainkit.distributed.watchdog import Watchdog

pytestmark = pytest.mark.serial  # timings: run alone (see pyproject.toml)

BLOCK_AT = 8  # the first sample of the third batch of 4: steps 1 and 2 complete first


class FakeClock:
    """A monotonic clock that moves only when told: looks see exactly the idle times set."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class BlockingDataset(Dataset):
    """Random samples; reading sample ``BLOCK_AT`` blocks on a pipe until a byte comes (a
    reader stuck in a system call, which recovers)."""

    def __init__(self, pipe: int, n: int = 24) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
        self.pipe = pipe

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index == BLOCK_AT:
            ready, _, _ = select.select([self.pipe], [], [], 120)
            assert ready, "the hang was never dumped"
        return self.x[index], self.y[index]


def release_when_dumped(log: Path, pipe: int) -> threading.Thread:
    """A thread that writes a byte into ``pipe`` once the watchdog has logged the hang (so its
    stacks are wholly written: the file exists from its first byte, the log line comes after
    the last), however long that takes on a loaded machine (or after 120 s, failing)."""

    def logged() -> bool:
        return log.is_file() and "hang: no progress" in log.read_text()

    def wait_for_the_dump() -> None:
        deadline = time.monotonic() + 120
        while not logged() and time.monotonic() < deadline:
            time.sleep(0.05)  # paces the check; the deadline only ends a failing test
        os.write(pipe, b"x")

    thread = threading.Thread(target=wait_for_the_dump, daemon=True)
    thread.start()
    return thread


def test_a_blocking_data_loader_is_dumped_and_reported_and_its_recovery_too(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    trainer = Trainer(TrainerConfig(device="cpu", max_steps=6, hang_timeout_s=1.0),
                      run_dir=tmp_path, checkpoint=CheckpointConfig(resume=None))
    read, write = os.pipe()
    releaser = release_when_dumped(tmp_path / "train.log", write)
    data = DataLoader(BlockingDataset(read), batch_size=4)
    try:
        summary = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    finally:
        releaser.join()
        os.close(read)
        os.close(write)

    assert summary["status"] == "completed" and summary["global_step"] == 6
    stacks = (tmp_path / "hangs" / "rank0.txt").read_text()
    assert "rank 0, no step after step 2 for" in stacks
    assert "in __getitem__" in stacks and "test_watchdog.py" in stacks, stacks
    log = (tmp_path / "train.log").read_text()
    hang = [line for line in log.splitlines() if "hang: no progress" in line]
    assert len(hang) == 1, log  # one line per hang, however many looks it lasted
    assert "rank 0 (last completed step 2, at __getitem__ (test_watchdog.py:" in hang[0]
    assert str(tmp_path / "hangs" / "rank0.txt") in hang[0]
    after = re.search(r"hang over: training moves again \(step (\d)\)", log.split(hang[0])[1])
    assert after and int(after[1]) > 2, log


def test_evaluations_and_saves_longer_than_the_timeout_are_no_hang(tmp_path: Path) -> None:
    clock = FakeClock()
    watchdog = Watchdog(timeout_s=60, run_dir=tmp_path, clock=clock)
    with watchdog:
        watchdog.beat(1)
        watchdog.look()
        with watchdog.busy("evaluation"), watchdog.busy("checkpoint"):
            clock.advance(1000)  # nested like a best-checkpoint save in an evaluation
            watchdog.look()  # their limit: 30 minutes
        clock.advance(50)  # the step clock restarted when the evaluation ended
        watchdog.look()
        assert not (tmp_path / "hangs").exists()
        clock.advance(11)  # but a step that does not end is a hang
        watchdog.look()
        assert "no step after step 1 for 61 s (limit 60 s)" in (
            tmp_path / "hangs" / "rank0.txt").read_text()


def test_zero_turns_it_off(tmp_path: Path) -> None:
    watchdog = Watchdog(timeout_s=0, run_dir=tmp_path)
    before = threading.active_count()
    with watchdog:
        assert threading.active_count() == before  # no thread at all


def counted_looks(enough: int) -> tuple[list[int], Callable[[], int], threading.Event]:
    """What Trainer passes to follow() (its step counter), counting the reads: it moves at every
    look (never a hang), and the event is set at the ``enough``-th read."""
    looks, done = [], threading.Event()

    def progress() -> int:
        looks.append(1)
        if len(looks) >= enough:
            done.set()
        return len(looks)

    return looks, progress, done


def test_watchdogs_share_one_thread_that_never_looks_at_one_exited(tmp_path: Path) -> None:
    def watching_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "trainkit-watchdog"]

    looks, progress, looked = counted_looks(3)  # entering reads it once, the looks the rest
    first = Watchdog(timeout_s=0.4, run_dir=tmp_path)  # polls every 0.1 s
    first.follow(progress)
    with first:
        assert looked.wait(timeout=60)
    seen = len(looks)
    (thread,) = watching_threads()
    _, second_progress, second_looked = counted_looks(3)
    second = Watchdog(timeout_s=0.4, run_dir=tmp_path)
    second.follow(second_progress)
    with second:
        assert second_looked.wait(timeout=60)  # the thread looked at the second one twice...
    assert len(looks) == seen  # ...and not once at the first, exited
    assert watching_threads() == [thread] and thread.is_alive()  # the same thread, still there
    assert not (tmp_path / "hangs").exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_process_forked_mid_fit_watches_only_its_own_watchdogs(tmp_path: Path) -> None:
    from trainkit.distributed.looks import LOOKS

    read, write = os.pipe()
    with Watchdog(timeout_s=60, run_dir=tmp_path) as parents:  # a fit that forks a worker
        pid = os.fork()
        if pid == 0:
            try:
                inherited = parents in LOOKS._due
                with Watchdog(timeout_s=60, run_dir=tmp_path) as own:
                    mine = own in LOOKS._due
                os.write(write, json.dumps([inherited, mine]).encode())
            finally:
                os._exit(0)
        os.close(write)
        ready, _, _ = select.select([read], [], [], 30)
        answer = json.loads(os.read(read, 100)) if ready else None
        if answer is None:  # stuck on a lock the watching thread held at the fork
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert answer == [False, True]  # the parent's fit is not watched (or reported) twice


def test_a_followed_counter_counts_from_where_the_watching_started() -> None:
    counter = [41]  # a resumed run's step counter: no step of this fit has completed yet
    watchdog = Watchdog(timeout_s=60)
    watchdog.follow(lambda: counter[0])
    with watchdog:
        assert watchdog._completed() is None  # so the first step gets its longer limit
        counter[0] = 42
        assert watchdog._completed() == 42


def test_the_automatic_limit_grows_with_the_slowest_step_seen() -> None:
    watchdog = Watchdog(timeout_s=None)
    assert (watchdog.limit("step"), watchdog.limit("first step")) == (300, 900)
    assert watchdog.limit("evaluation") == watchdog.limit("checkpoint") == 1800
    watchdog._owner = threading.get_ident()
    start = time.monotonic()  # step 1 ends, seen by a look; step 2 is seen 40 s in, then ends
    watchdog.beat(1)
    try:
        watchdog._look(start)
        watchdog._look(start + 40)
        watchdog.beat(2)
        watchdog._look(start + 42)
    finally:
        watchdog.arm_fallback(None)  # each look armed faulthandler's timer in this process
    assert watchdog.limit("step") == pytest.approx(400)
    assert Watchdog(timeout_s=7).limit("step") == 7  # an explicit limit is kept


def test_the_rank_behind_is_the_one_the_others_wait_for_in_a_collective() -> None:
    def record(step: int | None, seq: int, where: str | None = None) -> dict:
        return {"step": step, "idle_s": 31.0, "busy": None, "hung": True, "where": where,
                "seq": seq}

    # rank 1 never reached the all-reduce of step 3 that ranks 0 and 2 wait in
    records = {0: record(2, 41), 1: record(2, 40, "forward (nets.py:61)"), 2: record(2, 41)}
    assert behind_ranks(records) == [1]
    line = hang_line(records, "runs/x/hangs/rank<R>.txt")
    assert line == ("hang: no progress for 31 s; behind: rank 1 (last completed step 2, at "
                    "forward (nets.py:61)); waiting for it: ranks 0, 2 (step 2); every thread's "
                    "stack in runs/x/hangs/rank<R>.txt")
    records[3] = None  # a rank that never published a heartbeat is the one to look at
    assert behind_ranks(records) == [3]
    assert "behind: rank 3 (no heartbeat)" in hang_line(records, "x")
    assert json.dumps(records)  # records travel through the store as JSON


def test_a_store_that_stops_answering_does_not_end_the_watching(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The job's store goes away (its host restarted): the watchdog warns once and still sees
    this rank's hang and its end (it used to stop watching at the first failed call)."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, is_master=False,
                      timeout=datetime.timedelta(seconds=1))
    clock = FakeClock()
    watchdog = Watchdog(timeout_s=60, run_dir=tmp_path, world_size=2, clock=clock)
    with caplog.at_level(logging.INFO, logger="trainkit"), watchdog:
        watchdog._board = Board(client, 2)  # as under torchrun: the job's store, two ranks
        del server
        watchdog.beat(1)
        watchdog.look()
        clock.advance(61)
        watchdog.look()  # a hang, and the store does not answer
        watchdog.beat(2)
        watchdog.look()  # moving again
    assert "no step after step 1" in (tmp_path / "hangs" / "rank0.txt").read_text()
    store_lines = [r for r in caplog.records if "store did not answer" in r.getMessage()]
    assert len(store_lines) == 1
    assert any("hang over" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"hang_timeout_s": -1}, "trainer.hang_timeout_s must be >= 0 (0: off) or null"),
    ({"hang_timeout_s": True}, "trainer.hang_timeout_s must be >= 0"),
    ({"hang_timeout_s": "5m"}, "trainer.hang_timeout_s must be >= 0"),
    ({"hang_action": "kill"}, "trainer.hang_action='kill': use 'report' or 'abort'"),
])
def test_bad_settings_are_one_line_errors(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        TrainerConfig(**kwargs)


def test_the_keys_compose_with_their_defaults() -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from trainkit.entry.train import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["+exp=mnist", "trainer.hang_timeout_s=30"])
    settings = OmegaConf.to_object(cfg).trainer
    assert (settings.hang_timeout_s, settings.hang_action) == (30.0, "report")
