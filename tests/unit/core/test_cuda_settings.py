"""The CUDA settings' decisions, checked on the CPU: bf16 by compute capability, the backend
flags (set through torch's real setters, which exist in CPU builds too), deterministic mode."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from omegaconf import OmegaConf

from tests.unit.test_config import _compose
from trainkit.config import TrainerConfig
from trainkit.core.cuda_settings import (
    CUBLAS_WORKSPACE_ENV,
    apply_cuda_settings,
    deterministic_algorithms,
    set_backend_flags,
)
from trainkit.core.device import bf16_native
from trainkit.core.errors import ConfigError


@pytest.mark.parametrize(("capability", "native"), [
    ((6, 1), False), ((7, 0), False), ((7, 5), False),  # P40, V100, T4: emulated bf16 only
    ((8, 0), True), ((8, 6), True), ((8, 9), True), ((9, 0), True), ((10, 0), True),
    ((12, 0), True),
])
def test_bf16_is_decided_by_compute_capability(capability: tuple[int, int], native: bool) -> None:
    assert bf16_native(capability) is native


def test_rocm_gpus_run_bf16_natively() -> None:
    assert bf16_native((7, 0), hip=True)  # ROCm reports its own numbering (e.g. 9.0 for MI250)


@pytest.fixture
def backend_flags() -> Iterator[None]:
    """The process-wide flags as they were, after the test."""
    saved = (torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision(),
             torch.backends.cudnn.allow_tf32)
    yield
    torch.backends.cudnn.benchmark = saved[0]
    torch.set_float32_matmul_precision(saved[1])
    torch.backends.cudnn.allow_tf32 = saved[2]


@pytest.mark.usefixtures("backend_flags")
@pytest.mark.parametrize("on", [True, False])
def test_backend_flags_are_set_and_readable_through_both_apis(on: bool) -> None:
    assert set_backend_flags(cudnn_benchmark=on, tf32=on) is on
    assert torch.backends.cudnn.benchmark is on and torch.backends.cudnn.allow_tf32 is on
    # torch.compile's Inductor reads the legacy value: it must not raise "mix of legacy and new
    # APIs", and the per-backend values agree.
    assert torch.get_float32_matmul_precision() == ("high" if on else "highest")
    assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if on else "ieee")


@pytest.mark.usefixtures("backend_flags")
def test_autotuning_stays_off_under_deterministic_algorithms() -> None:
    with deterministic_algorithms():
        assert set_backend_flags(cudnn_benchmark=True, tf32=True) is False
        assert torch.backends.cudnn.benchmark is False


@pytest.mark.usefixtures("backend_flags")
def test_cpu_runs_leave_the_flags_alone() -> None:
    torch.backends.cudnn.benchmark = False
    assert apply_cuda_settings(torch.device("cpu"), cudnn_benchmark=True, tf32=True) == ""
    assert torch.backends.cudnn.benchmark is False


def test_deterministic_mode_is_on_inside_and_restored_after(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.delenv(CUBLAS_WORKSPACE_ENV, raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic
    with deterministic_algorithms():
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ[CUBLAS_WORKSPACE_ENV] == ":4096:8"
    assert (torch.are_deterministic_algorithms_enabled(),
            torch.backends.cudnn.deterministic) == before
    assert CUBLAS_WORKSPACE_ENV not in os.environ
    monkeypatch.setenv(CUBLAS_WORKSPACE_ENV, ":16:8")  # the user's own deterministic choice
    with deterministic_algorithms():
        assert os.environ[CUBLAS_WORKSPACE_ENV] == ":16:8"


def test_the_keys_default_to_on_and_take_only_booleans() -> None:
    settings = OmegaConf.to_object(_compose("+exp=mnist", "trainer.tf32=false"))
    assert settings.trainer.cudnn_benchmark is True and settings.trainer.tf32 is False
    with pytest.raises(ConfigError, match=r"trainer\.tf32 must be true or false"):
        TrainerConfig(tf32="yes")  # type: ignore[arg-type]
