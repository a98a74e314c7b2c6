"""The rule by which a sharded checkpoint's data position and RNG carry over to a resume."""

from __future__ import annotations

import random

import pytest
import torch

from trainkit.checkpoint.reshard import carry_over
from trainkit.core import rng
from trainkit.loop.train_state import TrainState


@pytest.fixture(autouse=True)
def _keep_rng() -> None:
    saved = rng.get_rng_state()
    yield
    rng.set_rng_state(saved)


def meta(world_size: int, batch: int, batch_size: int = 16) -> dict:
    rng.seed_everything(123)
    per_rank = []
    for r in range(world_size):
        rng.seed_rank(r, 7)
        per_rank.append(rng.get_rng_state())
    return {"world_size": world_size, "batch_size": batch_size, "rng_per_rank": per_rank,
            "rng": per_rank[0], "trainer": {"batch_in_epoch": batch}}


def at(batch: int, step: int = 10) -> TrainState:
    return TrainState(global_step=step, epoch=1, batch_in_epoch=batch)


def test_the_same_world_size_restores_each_ranks_own_rng_and_the_exact_position() -> None:
    saved = meta(2, batch=5)
    state = at(5)
    assert carry_over(saved, state, rank=1, world_size=2, batch_size=16,
                      batches_per_epoch=8) == ""
    assert state.batch_in_epoch == 5 and state.epoch == 1
    assert torch.equal(torch.get_rng_state(), saved["rng_per_rank"][1]["torch"])


@pytest.mark.parametrize(("saved_world", "batch", "world", "batch_size", "expected"), [
    (2, 3, 1, 16, (1, 6)),   # 3 batches x 2 ranks x 16 = sample 96: batch 6 on 1 rank
    (2, 3, 1, 32, (1, 3)),   # twice the batch on 1 rank: the same global batches
    (4, 3, 2, 16, (1, 6)),
    (2, 3, 4, 16, (1, 1)),   # sample 96 of 4 x 16 per batch: rounded down to batch 1
    (2, 7, 4, 16, (2, 0)),   # sample 224 is past the 3 batches of 4 x 16 left: next epoch
])
def test_another_world_size_resumes_at_the_same_global_sample(
        saved_world: int, batch: int, world: int, batch_size: int,
        expected: tuple[int, int]) -> None:
    state = at(batch)
    per_epoch = 3 if world == 4 else 16
    line = carry_over(meta(saved_world, batch), state, rank=0, world_size=world,
                      batch_size=batch_size, batches_per_epoch=per_epoch)
    assert (state.epoch, state.batch_in_epoch) == expected
    assert f"saved on {saved_world} ranks, now {world}" in line


def test_another_world_size_reseeds_each_rank_from_its_seed_and_the_step() -> None:
    saved = meta(4, 2)

    def draws(rank: int) -> tuple[torch.Tensor, float]:
        rng.seed_rank(rank, 7)  # what the Trainer did before resuming
        carry_over(saved, at(2, step=10), rank=rank, world_size=2, batch_size=16,
                   batches_per_epoch=4)
        return torch.rand(3), random.random()

    first, second = draws(0), draws(1)
    assert torch.equal(draws(0)[0], first[0]) and draws(0)[1] == first[1]  # repeatable
    assert not torch.equal(first[0], second[0])  # each rank its own stream
