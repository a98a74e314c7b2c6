"""The DataLoader factory: options, seeding, sharding, resuming, signals, errors."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from trainkit.core.errors import ConfigError
from trainkit.core.signals import PREEMPTION_SIGNALS, shield_worker
from trainkit.data import ResumableLoader, default_num_workers, make_loader


class NoisyRange(Dataset):
    """Sample i is (i, a random draw): the draw shows how workers are seeded."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, float]:
        return i, torch.rand(()).item()


def _epoch(loader: ResumableLoader, epoch: int, start: int = 0) -> list[tuple[list, list]]:
    loader.set_epoch(epoch, start)
    return [(i.tolist(), r.tolist()) for i, r in loader]


def test_defaults_on_cpu() -> None:
    loader = make_loader(NoisyRange(10), 4, shuffle=False, num_workers=0)
    assert not loader.loader.pin_memory and loader.loader.num_workers == 0
    assert len(loader) == 3 and loader.batch_size == 4
    assert [i for i, _ in _epoch(loader, 0)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_worker_defaults_follow_cpus_and_processes_per_node() -> None:
    alone = default_num_workers(1)
    assert 0 <= alone <= 8
    assert default_num_workers(10_000) == 0  # more processes than CPUs: load in-process
    loader = make_loader(NoisyRange(10), 4, shuffle=True, num_workers=1, prefetch_factor=3)
    assert loader.loader.persistent_workers and loader.loader.prefetch_factor == 3


def test_same_seed_same_order_in_process() -> None:
    # without workers, samples draw from the process's generators (seed_everything, checkpoints)
    a = make_loader(NoisyRange(40), 8, shuffle=True, seed=5, num_workers=0)
    b = make_loader(NoisyRange(40), 8, shuffle=True, seed=5, num_workers=0)
    assert [i for i, _ in _epoch(a, 1)] == [i for i, _ in _epoch(b, 1)]
    assert [i for i, _ in _epoch(a, 1)] != [i for i, _ in _epoch(b, 2)]


def test_same_seed_same_batches_and_worker_draws() -> None:
    workers = 2
    a = make_loader(NoisyRange(40), 8, shuffle=True, seed=5, num_workers=workers,
                    persistent_workers=False)
    b = make_loader(NoisyRange(40), 8, shuffle=True, seed=5, num_workers=workers,
                    persistent_workers=False)
    first = _epoch(a, 1)
    assert first == _epoch(b, 1)
    assert sorted(i for idx, _ in first for i in idx) == list(range(40))
    again = _epoch(a, 1)  # rerunning an epoch repeats its order and its random draws
    assert again == first
    other_epoch = _epoch(a, 2)
    assert [i for i, _ in other_epoch] != [i for i, _ in first]
    assert [r for _, r in other_epoch] != [r for _, r in first]
    c = make_loader(NoisyRange(40), 8, shuffle=True, seed=6, num_workers=workers)
    assert [i for i, _ in _epoch(c, 1)] != [i for i, _ in first]


def test_workers_of_one_loader_draw_differently() -> None:
    loader = make_loader(NoisyRange(16), 4, shuffle=False, num_workers=2)
    draws = [r for _, r in _epoch(loader, 0)]
    assert draws[0] != draws[1]  # batch 0 from worker 0, batch 1 from worker 1


def test_ranks_get_disjoint_equal_shards() -> None:
    shards = [make_loader(NoisyRange(103), 10, shuffle=True, seed=1, rank=r, world_size=4,
                          num_workers=0) for r in range(4)]
    seen = [{i for idx, _ in _epoch(s, 3) for i in idx} for s in shards]
    assert [len(s) for s in seen] == [25] * 4
    assert len(set().union(*seen)) == 100
    assert {len(s) for s in shards} == {3}


def test_evaluation_shards_cover_every_sample_once() -> None:
    shards = [make_loader(NoisyRange(103), 10, shuffle=False, rank=r, world_size=4,
                          num_workers=0) for r in range(4)]
    seen = sorted(i for s in shards for idx, _ in _epoch(s, 0) for i in idx)
    assert seen == list(range(103))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_skips_batches_without_loading_them(workers: int) -> None:
    loaded: list[int] = []

    class Counting(NoisyRange):
        def __getitem__(self, i: int) -> tuple[int, float]:
            loaded.append(i)
            return super().__getitem__(i)

    loader = make_loader(Counting(50), 8, shuffle=True, seed=2, num_workers=workers)
    full = [i for i, _ in _epoch(loader, 4)]
    loaded.clear()
    rest = [i for i, _ in _epoch(loader, 4, start=3)]
    assert rest == full[3:]
    assert len(loader) == 7  # the whole epoch, also right after a mid-epoch start
    if workers == 0:  # (workers load in other processes: this list only sees the main one)
        assert len(loaded) == 50 - 3 * 8
    assert loader.state_dict() == {}  # no position in the loader: its caller holds it
    assert [i for i, _ in _epoch(loader, 4)] == full  # the offset applied to one pass only


def test_a_resume_mid_epoch_is_batches_from_the_callers_position() -> None:
    """Two batches handed out, then a fresh loader asked for the rest; an older state that
    saved a position still loads (the position is ignored: the caller holds it)."""
    loader = make_loader(NoisyRange(50), 8, shuffle=True, seed=2, num_workers=0)
    loader.set_epoch(1)
    it = iter(loader)
    next(it), next(it)
    expected = next(it)[0].tolist()
    fresh = make_loader(NoisyRange(50), 8, shuffle=True, seed=2, num_workers=0)
    fresh.load_state_dict({"epoch": 1, "batch": 2, **loader.state_dict()})
    assert next(fresh.batches(1, 2))[0].tolist() == expected


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_workers": -1}, "num_workers"),
    ({"num_workers": 0, "prefetch_factor": 2}, "prefetch_factor"),
    ({"num_workers": 0, "persistent_workers": True}, "persistent_workers"),
    ({"batch_size": 64, "drop_last": True}, "drop_last"),
    ({"batch_size": 0}, "batch_size"),
    ({"rank": 2, "world_size": 2}, "rank 2"),
])
def test_impossible_settings_are_config_errors(kwargs: dict, match: str) -> None:
    args = {"batch_size": 4, "shuffle": True, **kwargs}
    with pytest.raises(ConfigError, match=match) as info:
        make_loader(NoisyRange(20), **args)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pin_memory_without_cuda_is_refused() -> None:
    assert not make_loader(NoisyRange(8), 4, shuffle=False, num_workers=0).loader.pin_memory
    with pytest.raises(ConfigError, match="pin_memory"):
        make_loader(NoisyRange(8), 4, shuffle=False, num_workers=0, pin_memory=True)


def test_resume_with_workers_repeats_the_random_draws_exactly() -> None:
    # Workers seed once per batch from (seed, epoch, rank, batch): a pass that starts at batch 3
    # gets the very draws the full pass got there, whichever worker loads which batch.
    loader = make_loader(NoisyRange(50), 8, shuffle=True, seed=2, num_workers=2)
    full = _epoch(loader, 4)
    assert _epoch(loader, 4, start=3) == full[3:]
    other_rank = make_loader(NoisyRange(50), 8, shuffle=True, seed=2, rank=1, world_size=2,
                             num_workers=2)
    assert _epoch(other_rank, 4)[0][1] != full[0][1][:4]  # ranks draw differently


class WorkerPid(NoisyRange):
    """Sample i is (i, the pid of the process that loaded it, a tag set by worker_init_fn)."""

    tag = 0

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        return i, os.getpid(), WorkerPid.tag


def _tag_worker(worker_id: int) -> None:
    WorkerPid.tag = 100 + worker_id


def _signals_pending(pid: int) -> int:
    """The signals sent to process ``pid`` that it has not taken yet (a mask; 0 without /proc)."""
    status = Path(f"/proc/{pid}/status")
    if not status.is_file():
        return 0
    masks = [line.split(":")[1] for line in status.read_text().splitlines()
             if line.startswith(("SigPnd:", "ShdPnd:"))]
    return sum(int(mask, 16) for mask in masks)


def _wait_until_taken(pid: int) -> None:
    """Until ``pid`` has taken (or died of) every signal sent to it: an ignored signal is gone
    when ``kill`` returns, a blocked SIGTERM waits for the shield's thread to read it."""
    deadline = time.monotonic() + 60
    while _signals_pending(pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # paces the check; the deadline only ends a failing test


def test_workers_outlive_group_signals_and_still_run_the_users_worker_init() -> None:
    loader = make_loader(WorkerPid(64), 4, shuffle=False, num_workers=2,
                         worker_init_fn=_tag_worker)
    it = iter(loader)
    _, pids, tags = next(it)
    assert set(tags.tolist()) == {100}  # the user's worker_init_fn ran after trainkit's
    for signum in PREEMPTION_SIGNALS:  # sent by another process, as `kill -- -PGID` does
        subprocess.run(["kill", f"-{signal.Signals(signum).name[3:]}", str(pids[0].item())],
                       check=True)
    _wait_until_taken(pids[0].item())
    assert len(list(it)) == 15  # no "DataLoader worker (pid N) is killed by signal"


def _shielded_then_answer(conn: multiprocessing.connection.Connection) -> None:
    shield_worker()
    conn.send("shielded")
    while conn.recv() == "alive?":
        conn.send("yes")


def test_a_shielded_worker_still_obeys_its_parents_sigterm() -> None:
    # The DataLoader terminates a stuck worker with SIGTERM from the parent: that still works.
    context = multiprocessing.get_context("fork")
    ours, its = context.Pipe()
    proc = context.Process(target=_shielded_then_answer, args=(its,), daemon=True)
    proc.start()
    assert ours.poll(60) and ours.recv() == "shielded"
    subprocess.run(["kill", "-TERM", str(proc.pid)], check=True)  # another sender: ignored
    _wait_until_taken(proc.pid)
    ours.send("alive?")
    assert ours.poll(60), "the worker did not answer"
    answer = ours.recv() if proc.is_alive() else f"died, exit code {proc.exitcode}"
    assert answer == "yes"
    proc.terminate()  # the parent's
    proc.join(60)
    assert proc.exitcode == 0


def test_every_trainkit_loader_implements_the_resume_protocol(mnist_root: Path) -> None:
    """One protocol (ResumableData) for the Trainer to rely on, not duck typing."""
    from trainkit.data import DevicePrefetcher, InMemoryLoader, ResumableData
    from trainkit.data.sources.tensors import load_mnist

    data = load_mnist(mnist_root, train=True, verify=False, download=False)
    dataset = torch.utils.data.TensorDataset(data.images, data.labels)
    loaders = [InMemoryLoader(data, 16, shuffle=True), make_loader(dataset, 16, shuffle=True,
                                                                   num_workers=0)]
    loaders.append(DevicePrefetcher(loaders[1], "cpu"))
    for loader in loaders:
        assert isinstance(loader, ResumableData), type(loader).__name__
        loader.set_epoch(2, start_batch=3)
        assert len(list(loader)) == len(loader) - 3  # that pass from batch 3
        assert "batch" not in loader.state_dict()  # the caller holds the position
    assert not isinstance([(torch.zeros(1), torch.zeros(1))], ResumableData)  # a plain list


def test_batches_of_an_epoch_from_a_start_leave_the_loaders_position_alone() -> None:
    """``batches(epoch, start)`` serves a pass for a caller that holds the position: the same
    batches as ``set_epoch`` then ``iter``, and the loader's own position untouched."""
    from trainkit.data import DevicePrefetcher, InMemoryLoader, TensorData

    loader = make_loader(NoisyRange(50), 8, shuffle=True, seed=2, num_workers=0)
    torch.manual_seed(0)
    full = [i for i, _ in _epoch(loader, 3)]
    before = loader.state_dict()
    assert [i.tolist() for i, _ in loader.batches(3, 2)] == full[2:]
    assert loader.state_dict() == before

    data = TensorData(torch.arange(40, dtype=torch.uint8).view(40, 1, 1, 1).expand(40, 1, 2, 2),
                      torch.arange(40), (0.5,), (0.5,), 40)
    fed = DevicePrefetcher(InMemoryLoader(data, 8, shuffle=True, seed=1), "cpu")
    fed.set_epoch(5)
    whole = [y.tolist() for _, y in fed]
    position = fed.state_dict()
    assert [y.tolist() for _, y in fed.batches(5, 3)] == whole[3:]
    assert fed.state_dict() == position
