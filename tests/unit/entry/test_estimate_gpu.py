"""``trainkit estimate`` on this machine's GPU, beyond one resnet50 step: the 0.9 headroom of
its memory, the largest micro-batch it finds run for real at that size, and DDP's buckets and
FSDP's shares per rank against a real step on a 1-rank NCCL group (what one GPU allows)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.unit.entry.test_estimate import _compose
from trainkit.core.runtime import Runtime
from trainkit.distributed import fsdp
from trainkit.entry import estimate
from trainkit.entry.build import build_criterion, build_forward
from trainkit.loop.precision import Precision
from trainkit.loop.step import WindowStep
from trainkit.models.build import make_model
from trainkit.models.param_groups import build_optimizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
RESNET50 = ["model=resnet50", "data=image_folder", "data.num_classes=1000",
            "data.batch_size=128", "trainer.precision=bf16-mixed"]
GPT = ["+exp=lm", "data.num_classes=512", "data.seq_len=512", "data.batch_size=16",
       "model.dim=768", "model.layers=6", "model.heads=12", "trainer.precision=bf16-mixed",
       "optim.fused=null"]


def _step_peak(cfg, plan: estimate.MemoryPlan, micro_batch: int, wrap=lambda m, o: m) -> int:
    """torch.cuda.max_memory_allocated over a steady-state step of ``micro_batch`` samples."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = make_model(cfg.model, pretrained=False).to(device)
    optimizer = build_optimizer(model, OmegaConf.to_container(cfg.optim, resolve=True),
                                lambda n, g: instantiate(n, params=g, _convert_="all"))
    step = WindowStep(wrap(model, optimizer).train(), optimizer=optimizer,
                      precision=Precision(plan.precision, device),
                      criterion=build_criterion(cfg), forward=build_forward(cfg), device=device)
    make = estimate.sample_batch(plan.settings, micro_batch, "cuda")
    step([make()])  # the optimizer's state is made
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step([make()])
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def test_a_run_may_plan_on_90_percent_of_this_gpu() -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    target = estimate.find_target(None)
    assert target.total == total and target.usable == int(0.9 * total)
    report = estimate.estimate(_compose(RESNET50), target, 1)
    assert report["usable_gib"] == pytest.approx(0.9 * total / 2**30)


def test_the_largest_micro_batch_runs_here_near_the_usable_memory() -> None:
    """The search's answer, run for real: it fits this GPU, its peak is the estimate's for
    that size within 10%, and it is near the usable memory (not a cautious fraction)."""
    cfg = _compose(RESNET50)
    target = estimate.find_target(None)
    report = estimate.estimate(cfg, target, 1)
    largest = report["largest_micro_batch"]
    assert largest is not None and largest > 128
    plan = estimate.MemoryPlan.of(cfg, estimate._settings(cfg), target, 1)
    estimated = plan.per_rank(plan.trace(largest))
    measured = _step_peak(cfg, plan, largest)  # an OutOfMemoryError fails the test
    assert abs(estimated - measured) <= 0.1 * measured, (largest, estimated, measured)
    assert 0.8 * target.usable <= measured <= target.total, (largest, measured)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ddp_and_fsdp_per_rank_within_10_percent_on_one_gpu(strategy: str) -> None:
    """A GPT step wrapped by DDP (its buckets) or sharded by trainkit's FSDP2 on a 1-rank NCCL
    group, against the estimate's per-rank figure for that strategy."""
    cfg = _compose(GPT)
    target = estimate.find_target(None)
    plan = estimate.MemoryPlan.of(cfg, estimate._settings(cfg), target, 1)
    estimated = plan.per_rank(plan.trace(plan.micro_batch), 2 if strategy == "ddp" else 1,
                              strategy)

    def wrap(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        if strategy == "ddp":
            return torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
        return fsdp.shard_model(model, optimizer, Runtime.from_env("cuda"),
                                precision=plan.precision)

    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0,
                            world_size=1)  # as trainkit joins one (its host votes: gloo)
    try:
        measured = _step_peak(cfg, plan, plan.micro_batch, wrap)
    finally:
        dist.destroy_process_group()
    assert abs(estimated - measured) <= 0.1 * measured, (strategy, estimated, measured)
