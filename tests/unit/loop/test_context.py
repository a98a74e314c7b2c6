"""A step you write (trainkit.StepContext): several models and optimizers, frozen models, one loss
scale update per iteration, a NaN in one optimizer's loss, accumulation, bitwise resume, loss
parts, ctx.log and trainer.log, the evaluation's own random stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainkit import CheckpointConfig, Trainer, TrainerConfig, load_checkpoint
from trainkit.core.errors import TrainkitError
from trainkit.loop.context import ContextStep, StepContext
from trainkit.loop.precision import Precision

Z = 4


def _gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(Z, 8), nn.Tanh(), nn.Linear(8, 2)), nn.Linear(2, 1)


class Batches:
    """A resumable list of batches (trainkit's ResumableData protocol), shuffled per epoch."""

    def __init__(self, batches: list) -> None:
        self.batches, self.epoch, self.start = batches, 0, 0

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start = epoch, start_batch

    def __iter__(self):
        order = torch.randperm(len(self.batches), generator=torch.Generator().manual_seed(
            self.epoch)).tolist()
        for i in order[self.start:]:
            self.start += 1
            yield self.batches[i]
        self.start = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.start}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.start = state["epoch"], state["batch"]


def _data(n: int = 12, batch: int = 8) -> Batches:
    g = torch.Generator().manual_seed(1)
    return Batches([(torch.randn(batch, 2, generator=g) + 2,) for _ in range(n)])


def gan_step(ctx: StepContext, batch: tuple[torch.Tensor]) -> None:
    real = batch[0]
    g, d = ctx.models["g"], ctx.models["d"]
    fake = g(torch.randn(len(real), Z, device=ctx.device))
    d_real, d_fake = d(real), d(fake.detach())
    ones, zeros = torch.ones_like(d_real), torch.zeros_like(d_fake)
    ctx.optimize("d", F.binary_cross_entropy_with_logits(d_real, ones)
                 + F.binary_cross_entropy_with_logits(d_fake, zeros))
    ctx.optimize("g", F.binary_cross_entropy_with_logits(d(fake), ones), frozen=["d"])
    ctx.log(d_real=d_real.mean(), d_fake=d_fake.mean())


def _fit(run_dir: Path | None, stop_at_step: int | None = None, **config) -> tuple[dict, nn.Module,
                                                                                      nn.Module]:
    g, d = _gan()
    opt_g = torch.optim.Adam(g.parameters(), lr=1e-2)
    opt_d = torch.optim.SGD(d.parameters(), lr=1e-2, momentum=0.9)
    sched_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=3, gamma=0.5)
    trainer = Trainer(TrainerConfig(device="cpu", max_epochs=2, log_every_n_steps=2, **config),
                      run_dir=run_dir, checkpoint=CheckpointConfig(every_n_steps=5))
    summary = trainer.fit({"g": g, "d": d}, {"g": opt_g, "d": opt_d}, _data(), step=gan_step,
                          schedulers={"g": sched_g}, stop_at_step=stop_at_step)
    return summary, g, d


def test_a_gan_trains_both_models_and_logs_its_scalars(tmp_path: Path) -> None:
    g0, d0 = _gan()
    summary, g, d = _fit(tmp_path)
    assert summary["status"] == "completed" and summary["global_step"] == 24
    assert not torch.equal(g0[0].weight, g[0].weight)
    assert not torch.equal(d0.weight, d.weight)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = {key for line in lines for key in line}
    assert {"train/d_real", "train/d_fake", "train/loss_d", "train/loss_g", "train/lr_g",
            "train/lr_d"} <= logged
    # the scheduler of g stepped with g: 24 steps, halving every 3
    last = [line for line in lines if "train/lr_g" in line][-1]
    assert last["train/lr_g"] == pytest.approx(1e-2 * 0.5 ** 8)


def test_the_checkpoint_holds_every_model_and_optimizer_by_name(tmp_path: Path) -> None:
    _, g, d = _fit(tmp_path)
    state = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert set(state["models"]) == {"g", "d"} and set(state["optimizers"]) == {"g", "d"}
    assert set(state["schedulers"]) == {"g"}
    # the contract's keys: the first-named model and optimizer
    for key, value in g.state_dict().items():
        assert torch.equal(state["model"][key], value)
        assert torch.equal(state["models"]["g"][key], value)
    assert torch.equal(state["models"]["d"]["weight"], d.weight)
    assert state["optimizer"]["state"].keys() == state["optimizers"]["g"]["state"].keys()
    assert state["global_step"] == 24


def test_a_two_model_fit_stopped_and_resumed_is_bitwise_the_uninterrupted(tmp_path: Path) -> None:
    _, g_full, d_full = _fit(tmp_path / "full")
    summary, _, _ = _fit(tmp_path / "cut", stop_at_step=7)
    assert summary["status"] == "preempted" and summary["global_step"] == 7
    summary, g, d = _fit(tmp_path / "cut")
    assert summary["global_step"] == 24
    for a, b in zip([*g_full.parameters(), *d_full.parameters()],
                    [*g.parameters(), *d.parameters()]):
        assert torch.equal(a, b)
    full = load_checkpoint(tmp_path / "full" / "checkpoints" / "last.pt")
    cut = load_checkpoint(tmp_path / "cut" / "checkpoints" / "last.pt")
    for name in ("g", "d"):
        for key, value in full["optimizers"][name]["state"].items():
            for k, v in value.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(
                    cut["optimizers"][name]["state"][key][k]))
    assert full["schedulers"] == cut["schedulers"]


def _two_linears() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(3, 1), nn.Linear(3, 1)


def _ctx(a: nn.Module, b: nn.Module, precision: Precision, **kw) -> StepContext:
    return StepContext({"a": a, "b": b},
                       {"a": torch.optim.SGD(a.parameters(), lr=0.1),
                        "b": torch.optim.SGD(b.parameters(), lr=0.1)},
                       precision=precision, device=torch.device("cpu"), **kw)


def test_frozen_models_get_no_gradient_from_that_backward() -> None:
    a, b = _two_linears()
    x = torch.randn(4, 3)
    ctx = _ctx(a, b, Precision("32"))
    ctx._begin_window(False, False)
    ctx._begin_micro_batch(0, False, 1.0)  # not the last: gradients stay to be read
    ctx.optimize("a", (b(a(x).expand(4, 3))).sum(), frozen=["b"])
    assert a.weight.grad is not None and b.weight.grad is None
    b_grad = torch.ones_like(b.weight)
    b.weight.grad = b_grad.clone()
    ctx.optimize("b", b(x).sum())
    ctx._begin_micro_batch(1, False, 1.0)
    ctx.optimize("a", b(a(x).expand(4, 3)).sum(), frozen=["b"])
    # b's own gradient is kept as it was, not added to by a's backward through it
    assert torch.equal(b.weight.grad, b_grad + x.sum(0, keepdim=True))


def test_one_loss_scale_update_per_iteration_under_16_mixed() -> None:
    a, b = _two_linears()
    precision = Precision("16-mixed", "cpu")
    updates, steps = [], []
    update, scaler_step = precision.scaler.update, precision.scaler.step
    precision.scaler.update = lambda *args: (updates.append(1), update(*args))[1]
    precision.scaler.step = lambda opt: (steps.append(opt), scaler_step(opt))[1]
    ctx = _ctx(a, b, precision)
    step = ContextStep(lambda ctx, batch: (ctx.optimize("a", a(batch).sum()),
                                           ctx.optimize("b", b(batch).sum())), ctx)
    for _ in range(3):
        step([torch.randn(4, 3)])
    assert len(updates) == 3  # torch's recipe: scaler.step per optimizer, one update
    assert steps == [ctx.optimizers["a"], ctx.optimizers["b"]] * 3


def test_a_nan_in_one_optimizers_loss_skips_that_step_only_without_a_host_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _two_linears()
    a0, b0 = a.weight.detach().clone(), b.weight.detach().clone()
    ctx = _ctx(a, b, Precision("32"))

    def step_fn(ctx: StepContext, batch: torch.Tensor) -> None:
        ctx.optimize("a", a(batch).sum() * float("nan"))
        ctx.optimize("b", b(batch).sum())

    def no_read(self: torch.Tensor) -> None:
        raise AssertionError("host read")

    monkeypatch.setattr(torch.Tensor, "item", no_read)
    monkeypatch.setattr(torch.Tensor, "__bool__", no_read)
    result = ContextStep(step_fn, ctx)([torch.randn(4, 3)], guard_finite=True)
    monkeypatch.undo()
    assert torch.equal(a.weight, a0)  # zeroed gradients: plain SGD does not move
    assert not torch.equal(b.weight, b0)
    assert result.finite_flag is not None and not result.finite_flag


def test_each_optimizer_steps_once_per_window_with_weighted_losses() -> None:
    """Two micro-batches of 2 give the step of one batch of 4, per optimizer."""
    x = torch.randn(4, 3)
    a, b = _two_linears()
    ctx = _ctx(a, b, Precision("32"))
    calls = []

    def step_fn(ctx: StepContext, batch: torch.Tensor) -> None:
        calls.append(ctx.last)
        ctx.optimize("a", a(batch).pow(2).mean())
        ctx.optimize("b", b(batch).pow(2).mean())

    ContextStep(step_fn, ctx)([x[:2], x[2:]])
    assert calls == [False, True]
    ra, rb = _two_linears()
    for model in (ra, rb):
        model(x).pow(2).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    for p, q in zip([*a.parameters(), *b.parameters()], [*ra.parameters(), *rb.parameters()]):
        torch.testing.assert_close(p, q)


def test_a_second_optimize_of_one_optimizer_in_a_micro_batch_is_refused() -> None:
    a, b = _two_linears()
    step = ContextStep(lambda ctx, x: (ctx.optimize("a", a(x).sum()),
                                       ctx.optimize("a", a(x).sum())), _ctx(a, b, Precision("32")))
    with pytest.raises(TrainkitError, match="twice in one micro-batch"):
        step([torch.randn(2, 3)])
    with pytest.raises(TrainkitError, match="no optimizer of that name"):
        ContextStep(lambda ctx, x: ctx.optimize("c", a(x).sum()),
                    _ctx(a, b, Precision("32")))([torch.randn(2, 3)])


def test_several_models_without_a_step_are_refused() -> None:
    a, b = _two_linears()
    with pytest.raises(TrainkitError, match="step="):
        Trainer(TrainerConfig(device="cpu")).fit(
            {"a": a, "b": b}, {"a": torch.optim.SGD(a.parameters(), lr=0.1),
                               "b": torch.optim.SGD(b.parameters(), lr=0.1)}, [])


def _classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))


def _labelled(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n)]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_loss_parts_are_logged_for_training_and_evaluation_computed_once(tmp_path: Path) -> None:
    calls = []

    def criterion(outputs: torch.Tensor, targets: torch.Tensor):
        calls.append(1)
        ce = F.cross_entropy(outputs, targets)
        l2 = outputs.pow(2).mean() * 0.01
        return ce + l2, {"ce": ce, "l2": l2}

    model = _classifier()
    data = _labelled()
    summary = Trainer(TrainerConfig(device="cpu", max_epochs=1, log_every_n_steps=3),
                      run_dir=tmp_path).fit(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                            data, criterion=criterion, val_data=data[:2])
    assert len(calls) == 6 + 2  # once per training batch, once per evaluated batch
    lines = _metrics(tmp_path)
    train = [line for line in lines if "train/ce" in line]
    assert len(train) == 2 and all("train/l2" in line for line in train)
    assert summary["metrics"]["val/loss"] == pytest.approx(
        summary["metrics"]["val/ce"] + summary["metrics"]["val/l2"], rel=1e-5)


def test_select_applies_a_metric_to_one_output_of_several() -> None:
    from torchmetrics.classification import MulticlassAccuracy

    from trainkit import Select

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"a": self.a(x), "b": self.b(x)}

    def forward(model: nn.Module, batch):
        x, y = batch
        return model(x), {"a": y, "b": y % 2}

    def criterion(outputs, targets):
        return F.cross_entropy(outputs["a"], targets["a"]) + F.cross_entropy(outputs["b"],
                                                                              targets["b"])

    torch.manual_seed(0)
    model, data = TwoHeads(), _labelled()
    metrics = {"acc_a": Select(MulticlassAccuracy(3), output="a", target="a"),
               "acc_b": Select(MulticlassAccuracy(2), output="b", target="b")}
    summary = Trainer(TrainerConfig(device="cpu", max_epochs=1)).fit(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, criterion=criterion,
        forward=forward, val_data=data, metrics=metrics)
    model.eval()
    with torch.no_grad():
        x = torch.cat([b[0] for b in data])
        y = torch.cat([b[1] for b in data])
        out = model(x)
    expected_b = (out["b"].argmax(1) == y % 2).float().mean().item()
    assert summary["metrics"]["val/acc_b"] == pytest.approx(
        MulticlassAccuracy(2)(out["b"], y % 2).item())
    assert 0.0 <= expected_b <= 1.0
    assert summary["metrics"]["val/acc_a"] == pytest.approx(
        MulticlassAccuracy(3)(out["a"], y).item())
    metrics["acc_a"].reset()
    assert set(metrics["acc_a"].state_dict()) == set(metrics["acc_a"].metric.state_dict())


def test_a_callback_logs_into_the_sinks_at_the_current_step(tmp_path: Path) -> None:
    class Logs:
        def on_step_end(self, trainer: Trainer, step: int) -> None:
            if step % 2 == 0:
                trainer.log(twice=2.0 * step)

        def on_evaluation_end(self, trainer: Trainer, results, step: int) -> None:
            trainer.log(samples_seen=torch.tensor(step * 8.0))

    model = _classifier()
    Trainer(TrainerConfig(device="cpu", max_epochs=1, log_every_n_steps=100), run_dir=tmp_path,
            callbacks=[Logs()]).fit(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    _labelled(), val_data=_labelled(2))
    lines = _metrics(tmp_path)
    assert [(line["step"], line["train/twice"]) for line in lines if "train/twice" in line] == [
        (2, 4.0), (4, 8.0), (6, 12.0)]
    assert [(line["step"], line["train/samples_seen"]) for line in lines
            if "train/samples_seen" in line] == [(6, 48.0)]
    with pytest.raises(TrainkitError, match="during fit"):
        Trainer(TrainerConfig(device="cpu")).log(x=1.0)


def _draws(evaluate_every: int | None) -> tuple[list[float], nn.Module]:
    """A fit whose step draws training random numbers (dropout, torch.rand) and whose evaluation
    draws its own (an augmentation), evaluated every ``evaluate_every`` steps or never."""
    drawn = []

    def step(ctx: StepContext, batch) -> None:
        x, y = batch
        drawn.append(float(torch.rand(())))
        ctx.optimize("model", F.cross_entropy(ctx.models["model"](x), y))

    def evaluate(ctx, batch):
        x, y = batch
        return ctx.models["model"](x + torch.randn_like(x)), y

    model = _classifier()
    config = TrainerConfig(device="cpu", max_epochs=2, eval_every_n_steps=evaluate_every)
    data = _labelled()
    Trainer(config).fit(model, torch.optim.SGD(model.parameters(), lr=0.1), data, step=step,
                        val_data=data[:2] if evaluate_every else None, evaluate=evaluate,
                        criterion=F.cross_entropy)
    return drawn, model


def test_evaluation_draws_from_a_stream_of_its_own() -> None:
    plain, plain_model = _draws(None)
    evaluated, evaluated_model = _draws(2)
    assert plain == evaluated
    for p, q in zip(plain_model.parameters(), evaluated_model.parameters()):
        assert torch.equal(p, q)


def test_evaluate_logs_its_scalars_and_sees_every_model_in_eval_mode(tmp_path: Path) -> None:
    torch.manual_seed(0)
    teacher, student = nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.5)), nn.Linear(4, 3)
    modes = []

    def step(ctx: StepContext, batch) -> None:
        x, y = batch
        modes.append((ctx.models["teacher"].training, ctx.models["student"].training))
        with torch.no_grad():
            soft = ctx.models["teacher"](x).softmax(-1)
        logits = ctx.models["student"](x)
        ctx.optimize("student", F.cross_entropy(logits, y) + F.kl_div(
            logits.log_softmax(-1), soft, reduction="batchmean"))

    def evaluate(ctx, batch):
        x, y = batch
        assert not ctx.models["student"].training and not torch.is_grad_enabled()
        agree = (ctx.models["student"](x).argmax(1) == ctx.models["teacher"](x).argmax(1))
        ctx.log(agreement=agree.float().mean())
        return ctx.models["student"](x), y

    summary = Trainer(TrainerConfig(device="cpu", max_epochs=1), run_dir=tmp_path).fit(
        {"student": student, "teacher": teacher},
        {"student": torch.optim.SGD(student.parameters(), lr=0.1)}, _labelled(), step=step,
        val_data=_labelled(2), evaluate=evaluate)
    assert set(modes) == {(False, True)}  # the teacher, held by no optimizer, stays in eval
    assert 0.0 <= summary["metrics"]["val/agreement"] <= 1.0
    assert "val/loss" not in summary["metrics"]  # no criterion given with step=
    assert not any(p.requires_grad for p in teacher.parameters())
    state = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert set(state["models"]) == {"student", "teacher"} and set(state["optimizers"]) == {
        "student"}


def test_init_from_a_two_model_checkpoint_loads_each_model_by_name(tmp_path: Path) -> None:
    _, g, d = _fit(tmp_path / "first")
    g2, d2 = _gan()
    trainer = Trainer(TrainerConfig(device="cpu", max_steps=1),
                      checkpoint=CheckpointConfig(
                          init_from=str(tmp_path / "first" / "checkpoints" / "last.pt")))
    seen = {}

    def step(ctx: StepContext, batch) -> None:
        if not seen:
            seen.update({k: v.detach().clone() for k, v in ctx.models["d"].state_dict().items()})
        gan_step(ctx, batch)

    trainer.fit({"g": g2, "d": d2}, {"g": torch.optim.SGD(g2.parameters(), lr=0.0),
                                     "d": torch.optim.SGD(d2.parameters(), lr=0.0)},
                _data(), step=step)
    assert torch.equal(seen["weight"], d.weight)
    for p, q in zip(g.parameters(), g2.parameters()):
        assert torch.equal(p, q)


def test_the_checkpoint_reader_picks_a_model_of_a_two_model_fit_by_name(tmp_path: Path) -> None:
    """``model_weights(state, model_name=)``: the named model's weights; none, the first's; an
    unknown name is one line naming the models the checkpoint holds."""
    from trainkit.checkpoint.select import model_weights

    _, g, d = _fit(tmp_path)
    state = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    picked, which = model_weights(state, model_name="d")
    assert which == "raw" and set(picked) == set(d.state_dict())
    assert all(torch.equal(picked[k], v) for k, v in d.state_dict().items())
    first, _ = model_weights(state)
    assert first.keys() == model_weights(state, model_name="g")[0].keys() == g.state_dict().keys()
    assert all(torch.equal(first[k], v) for k, v in g.state_dict().items())
    with pytest.raises(TrainkitError, match=r"model_name=h: .*its models are g, d"):
        model_weights(state, model_name="h")
    with pytest.raises(TrainkitError, match="weights=ema: the EMA is the first model's"):
        model_weights(state, "ema", model_name="d")


def test_a_two_optimizer_fit_under_16_mixed_updates_the_loss_scale_once_per_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    updates = []
    update = torch.amp.GradScaler.update
    monkeypatch.setattr(torch.amp.GradScaler, "update",
                        lambda self, *a: (updates.append(1), update(self, *a))[1])
    summary, _, _ = _fit(tmp_path, precision="16-mixed", accumulate_grad_batches=2)
    assert summary["global_step"] == 12 and len(updates) == 12
    state = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert state["precision"]["scaler"]["_growth_tracker"] is not None


def test_a_dict_of_one_model_trains_as_the_plain_form(tmp_path: Path) -> None:
    """fit({"net": m}, {"net": opt}) without step= is the built-in step; the same weights."""
    data = _labelled()
    plain, named = _classifier(), _classifier()
    Trainer(TrainerConfig(device="cpu", max_epochs=1)).fit(
        plain, torch.optim.SGD(plain.parameters(), lr=0.1), data)
    Trainer(TrainerConfig(device="cpu", max_epochs=1), run_dir=tmp_path).fit(
        {"net": named}, {"net": torch.optim.SGD(named.parameters(), lr=0.1)}, data)
    for p, q in zip(plain.parameters(), named.parameters()):
        assert torch.equal(p, q)
    state = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert "models" not in state and set(state["model"]) == set(plain.state_dict())
