"""FLOPs per sample against analytic counts, MFU in a real CPU run's TensorBoard, metrics.jsonl
and summary.json, the peak table, and a count that changes nothing in the run."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from trainkit import Trainer
from trainkit.config import TrainerConfig
from trainkit.core.errors import ConfigError
from trainkit.loop.activations import apply_activation_checkpointing
from trainkit.loop.step import default_forward
from trainkit.models.gpt import GPT, lm_forward, lm_loss
from trainkit.observe import flops as flops_module
from trainkit.observe.flops import FlopsMeter, count_call, meta_copy, mfu_text
from trainkit.observe.peaks import compute_kind, datasheet_peak

CPU = torch.device("cpu")


def _gpt_count(model: GPT, batch: int, seq: int) -> flops_module.FlopCount:
    """Counted as the loop counts: the first forward (lm_forward's) through the meter."""
    meter = FlopsMeter(model, CPU, "32", peak_tflops=1.0)
    tokens = torch.zeros(batch, seq + 1, dtype=torch.long)
    meter.watch(model)
    logits, targets, _ = lm_forward(model, {"tokens": tokens})
    assert logits.shape == (batch, seq, 256) and torch.is_tensor(lm_loss(logits, targets))
    assert meter.per_sample is not None
    return meter.per_sample


def _gpt_analytic(model: GPT, seq: int) -> tuple[int, int]:
    """(forward + backward, the blocks' forward) per sample of ``seq`` tokens: 6 x the matmul
    weights x tokens, the output layer (tied to the embedding) included, plus attention's two
    batched matmuls (scores, weighted values: 2 x 2 x T^2 x dim a layer, causal or not) and their
    two gradients each in backward."""
    dim, layers = model.tokens.weight.shape[1], len(model.blocks)
    block_weights = sum(m.weight.numel() for m in model.blocks.modules()
                        if isinstance(m, nn.Linear))
    matmul_weights = block_weights + model.tokens.weight.numel()  # + the tied output layer
    attention_forward = 4 * seq * seq * dim * layers
    blocks_forward = 2 * block_weights * seq + attention_forward
    return 6 * matmul_weights * seq + 3 * attention_forward, blocks_forward


def test_gpt_flops_per_sample_are_6_n_t_plus_attention() -> None:
    model = GPT(vocab_size=256, block=128, dim=128, layers=4, heads=4)
    counted = _gpt_count(model, batch=4, seq=128)
    expected, _ = _gpt_analytic(model, 128)
    assert counted.model == pytest.approx(expected, rel=0.02)
    assert counted.recompute == 0


def test_activation_checkpointing_recompute_is_counted_apart() -> None:
    model = GPT(vocab_size=256, block=64, dim=64, layers=3, heads=4)
    apply_activation_checkpointing(model, ["Block"])
    counted = _gpt_count(model, batch=2, seq=64)
    expected, blocks_forward = _gpt_analytic(model, 64)
    assert counted.model == pytest.approx(expected, rel=0.02)  # MFU's FLOPs: unchanged
    # each block's forward again, but for its last linear: torch's non-reentrant checkpoint
    # stops recomputing once the activations backward needs are back (the MLP's output is none)
    seq, dim = 64, 64
    last_linears = 3 * 2 * seq * (4 * dim * dim)
    assert counted.recompute == pytest.approx(blocks_forward - last_linears, rel=0.02)


def test_resnet18_flops_are_conv_and_linear_macs_times_2_times_3() -> None:
    from torchvision.models import resnet18

    model = resnet18(num_classes=1000)
    macs: dict[str, int] = {}

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[torch.Tensor], out: torch.Tensor) -> None:
            if isinstance(module, nn.Conv2d):
                kh, kw = module.kernel_size
                per_output = module.in_channels // module.groups * kh * kw
                macs[name] = out[0].numel() * per_output
            else:
                macs[name] = module.in_features * module.out_features
        return hook

    shapes = meta_copy(model)  # output sizes from a plain meta forward, no flop counter
    for name, module in shapes.named_modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            module.register_forward_hook(record(name))
    shapes(torch.empty(1, 3, 224, 224, device="meta"))
    assert sum(macs.values()) == pytest.approx(1.814e9, rel=0.01)  # resnet18's published GMACs
    # forward 2 x MACs; backward 2 x MACs for the weights and 2 x for the inputs, except the
    # first convolution's: the images need no gradient
    expected = 6 * sum(macs.values()) - 2 * macs["conv1"]
    counted = count_call(meta_copy(model), (torch.zeros(2, 3, 224, 224),), {})
    assert counted.model / 2 == pytest.approx(expected, rel=0.02)


def test_counting_draws_nothing_and_touches_no_weight() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 2))
    apply_activation_checkpointing(model, ["Dropout"])
    before = [p.detach().clone() for p in model.parameters()]
    inputs = torch.randn(4, 8)
    rng = torch.get_rng_state()
    meter = FlopsMeter(model, CPU, "32", peak_tflops=1.0)
    counted = meter.count((inputs,), {}, samples=4)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    # per sample: forward 2 x MACs, backward 2 x MACs (weights) + the second layer's input's
    assert counted is not None and counted == (2 * (8 * 16 + 16 * 2) * 2 + 2 * 16 * 2, 0)
    assert meter.count((torch.ones(1),), {}, samples=1) == counted  # once only


def test_the_hook_counts_the_first_call_then_goes() -> None:
    model = nn.Linear(4, 2)
    meter = FlopsMeter(model, CPU, "32", peak_tflops=1.0)
    meter.watch(model)
    inputs = torch.ones(3, 4)
    assert torch.equal(model(inputs), inputs @ model.weight.T + model.bias)  # the call as ever
    assert meter.per_sample == (2 * 4 * 2 * 2, 0) and not model._forward_pre_hooks
    never = nn.Linear(4, 2)  # a fit that took no step: its summary takes the hook away
    idle = FlopsMeter(never, CPU, "32", peak_tflops=1.0)
    idle.watch(never)
    assert idle.summary() == {} and not never._forward_pre_hooks


class _ReadsValues(nn.Linear):
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return super().forward(inputs) * float(inputs.sum())  # a host read


def test_a_model_that_needs_values_leaves_mfu_out_with_a_line(
        caplog: pytest.LogCaptureFixture) -> None:
    model = _ReadsValues(4, 2)
    meter = FlopsMeter(model, CPU, "32", peak_tflops=1.0)
    with caplog.at_level("INFO", logger="trainkit"):
        meter.watch(model)
        default_forward(model, (torch.ones(2, 4), torch.zeros(2)))
    lines = [r.getMessage() for r in caplog.records if "FLOPs not counted" in r.getMessage()]
    assert lines == ["FLOPs not counted, so no throughput/tflops or MFU: the model's forward "
                     "reads values of its inputs (Tensor.item()), and they are counted on shapes "
                     "alone"], lines
    assert meter.window(10, 1.0) == {} and meter.summary() == {}


@pytest.mark.parametrize(("name", "kind", "expected"), [
    ("NVIDIA H100 80GB HBM3", "bf16", (989.5, "H100 SXM bf16")),
    ("NVIDIA H100 PCIe", "tf32", (378.0, "H100 PCIe tf32")),
    ("NVIDIA H200", "bf16", (989.5, "H200 SXM bf16")),
    ("NVIDIA GH200 480GB", "fp32", (67.0, "GH200 fp32")),
    ("NVIDIA A100-SXM4-80GB", "tf32", (156.0, "A100 tf32")),
    ("NVIDIA L40S", "fp16", (362.05, "L40S fp16")),  # datasheet: 362.05 | 733*
    ("NVIDIA L4", "bf16", (121.0, "L4 bf16")),
    ("NVIDIA A10G", "bf16", (125.0, "A10/A10G bf16")),
    ("Tesla V100-SXM2-32GB", "fp16", (125.0, "V100 SXM2 fp16")),
    ("NVIDIA GeForce RTX 4090", "bf16", (165.2, "RTX 4090 bf16")),
    ("NVIDIA GeForce RTX 3090", "fp16", (71.0, "RTX 3090 fp16")),
    ("Tesla V100-PCIE-16GB", "bf16", None),  # no bf16 unit: measured instead
    ("Some Future GPU", "bf16", None),
])
def test_the_datasheet_table(name: str, kind: str, expected: tuple | None) -> None:
    assert datasheet_peak(name, kind) == expected


def test_the_cpu_peak_is_a_measured_matmul_in_the_runs_precision() -> None:
    assert compute_kind("32", CPU) == "fp32" and compute_kind("bf16-mixed", CPU) == "bf16"
    peak, source = flops_module.device_peak(CPU, "32")
    assert 0 < peak < 100 and source.startswith("measured: fp32 matmul on cpu")
    assert flops_module.device_peak(CPU, "32") == (peak, source)  # once per process
    assert flops_module.device_peak(CPU, "32", 2.5) == (2.5, "trainer.peak_tflops (fp32)")


@pytest.mark.parametrize("value", [0, -1.0, True, "fast"])
def test_peak_tflops_must_be_a_positive_number(value: object) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.peak_tflops must be a number > 0"):
        TrainerConfig(peak_tflops=value)


def _fit(run_dir: Path | None, **config: object) -> tuple[dict, nn.Module]:
    torch.manual_seed(0)
    data = [(torch.randn(16, 32), torch.randint(0, 4, (16,))) for _ in range(6)]
    model = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.2), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(TrainerConfig(max_epochs=2, log_every_n_steps=3, device="cpu",
                                    advice=False, **config), run_dir=run_dir)
    return trainer.fit(model, optimizer, data), model


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("mfu") / "run"
    return run_dir, _fit(run_dir)[0]


def test_a_cpu_run_logs_mfu_to_tensorboard_metrics_and_summary(cpu_run: tuple[Path, dict]
                                                                ) -> None:
    run_dir, summary = cpu_run
    per_sample = 2 * (32 * 64 + 64 * 4) + 2 * (32 * 64 + 64 * 4) + 2 * 64 * 4
    assert summary["flops_per_sample"] == per_sample
    assert summary["peak_source"].startswith("measured: fp32 matmul on cpu")
    assert summary["mfu"] == pytest.approx(summary["tflops"] / summary["peak_tflops"])
    assert summary["mfu"] > 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if "train/loss" in line]
    assert len(train) == 4 and all(
        line["throughput/mfu"] > 0 and line["throughput/tflops"] == pytest.approx(
            per_sample * line["throughput/samples_per_s"] / 1e12) for line in train)
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("throughput/mfu")] == [3, 6, 9, 12]
    assert [e.step for e in events.Scalars("throughput/tflops")] == [3, 6, 9, 12]
    assert mfu_text(summary).startswith(f"MFU {summary['mfu']:.0%} (")


def test_counting_leaves_the_runs_weights_bitwise_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    _, counted = _fit(None, peak_tflops=1.0)
    monkeypatch.setattr(FlopsMeter, "watch", lambda self, model: None)
    summary, plain = _fit(None, peak_tflops=1.0)
    assert "mfu" not in summary  # nothing was counted in this one
    assert all(torch.equal(a, b) for a, b in zip(counted.state_dict().values(),
                                                 plain.state_dict().values()))


def test_the_probe_reports_flops_the_matmul_and_the_mfu_of_its_phases() -> None:
    from trainkit.entry.probe import _flops_lines, _mfu
    from trainkit.loop.throughput import Phase

    model = nn.Linear(4, 2)
    meter = FlopsMeter(model, CPU, "32", peak_tflops=1e-6)  # 1 MFLOP/s: MFU of 2 samples/s
    meter.watch(model)
    default_forward(model, (torch.ones(3, 4), torch.zeros(3)))
    alone, together = (Phase(name, rate, rate, None, 0.1, 0.01, 1.0, 10)
                       for name, rate in (("step", 20.0), ("together", 10.0)))
    report = _mfu(meter, SimpleNamespace(device=CPU), alone, together)  # a Runtime's device
    per_sample = 2 * 4 * 2 * 2  # forward and the weights' gradient (the input needs none)
    assert report["flops_per_sample"] == per_sample and report["kind"] == "fp32"
    assert report["alone"] == pytest.approx(20 * per_sample / 1e6)
    assert report["together"] == pytest.approx(10 * per_sample / 1e6)
    assert report["matmul_tflops"] > 0
    lines = _flops_lines(report).splitlines()
    assert lines[0].startswith(f"model: {per_sample / 1e9:.4g} GFLOP per sample")
    assert f"MFU step alone {report['alone']:.1%}, together {report['together']:.1%}" in lines[0]
    assert lines[1].endswith(f"(for runs: trainer.peak_tflops={report['matmul_tflops']:.4g})")
