"""Token-normalised loss: a window's loss over padded text is its summed token loss over the
window's count of valid tokens, so 1 x 32 and 4 x 8 accumulation give one gradient (2 ranks x 16:
tests/dist/test_token_loss.py); sample-weighted means of means (the rule without a count) do
not; steps without a count keep their sample weighting bitwise; val/loss is a token mean."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.token_loss_window import batches, texts, tiny_lm, window_gradient
from trainkit.loop.evaluation import evaluate
from trainkit.loop.precision import Precision
from trainkit.loop.step import WindowStep, default_forward
from trainkit.models.hf import count_targets, hf_forward

pytest.importorskip("transformers")


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)


def differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in a)


def by_samples(model: nn.Module, window: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The rule without a count: each micro-batch's mean loss weighted by its samples."""
    return window_gradient(model, window, forward=lambda m, b: hf_forward(m, b))


@pytest.fixture(scope="module")
def whole() -> dict[str, torch.Tensor]:
    """The gradient of one batch of 32 padded texts: the token mean over all of them."""
    return window_gradient(tiny_lm(), batches(texts(), 32))


def test_accumulation_of_4_x_8_gives_the_gradient_of_one_batch_of_32(whole: Any) -> None:
    assert_close(window_gradient(tiny_lm(), batches(texts(), 8)), whole)
    # the model's own loss and a criterion over hf_forward's logits: the same rule
    assert_close(window_gradient(tiny_lm(), batches(texts(), 8),
                                 criterion=nn.CrossEntropyLoss()), whole)


def test_a_mean_of_sample_weighted_means_gives_another_gradient(whole: Any) -> None:
    # the same texts with the count left out: short texts' tokens weigh more
    assert by_samples(tiny_lm(), batches(texts(), 32)).keys() == whole.keys()
    assert_close(by_samples(tiny_lm(), batches(texts(), 32)), whole)  # one batch: alike
    assert differs(by_samples(tiny_lm(), batches(texts(), 8)), whole) > 0.05


def test_a_step_of_your_own_declares_its_count_and_hands_over_sums(whole: Any) -> None:
    def lm_step(ctx: Any, batch: dict[str, torch.Tensor]) -> None:
        logits = ctx.models["model"](input_ids=batch["input_ids"],
                                     attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                               reduction="sum")
        assert torch.equal(ctx.count, count_targets(batch))
        ctx.optimize("model", loss)

    lm_step.count_targets = count_targets  # type: ignore[attr-defined]
    assert_close(window_gradient(tiny_lm(), batches(texts(), 8), step=lm_step), whole)


def test_a_step_without_a_count_keeps_its_sample_weighting_bitwise() -> None:
    """As a fixed-length LM (+exp=lm) trains: each micro-batch's mean times its share of the
    window's samples, backward, summed; the step's gradient and loss bitwise that."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 8), nn.Flatten(0, 1), nn.Linear(8, 32))
    gen = torch.Generator().manual_seed(2)
    window = [(torch.randint(0, 32, (n, 6), generator=gen),
               torch.randint(0, 32, (n * 6,), generator=gen)) for n in (3, 5, 3)]
    expected, losses = {}, []
    for inputs, targets in window:
        loss = F.cross_entropy(model(inputs), targets) * (len(inputs) / 11)
        loss.backward()
        losses.append(loss.detach())
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = window_gradient(model, window, forward=default_forward, criterion=F.cross_entropy)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    step = WindowStep(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                      precision=Precision("32"), criterion=F.cross_entropy,
                      forward=default_forward, device=torch.device("cpu"))
    assert step.count_targets is None
    assert torch.equal(step(window).loss, torch.stack(losses).sum())


def test_the_logged_loss_is_the_windows_token_mean() -> None:
    model, window = tiny_lm(), batches(texts(), 8)
    step = WindowStep(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                      precision=Precision("32"), criterion=nn.CrossEntropyLoss(),
                      forward=hf_forward, device=torch.device("cpu"))
    loss = step(window).loss
    with torch.no_grad():
        logits, labels = hf_forward(model, batches(texts(), 32)[0])
        token_mean = F.cross_entropy(logits, labels)  # -100 ignored: over the real tokens
    torch.testing.assert_close(loss, token_mean, rtol=1e-5, atol=0)


def test_validation_loss_over_padded_text_is_a_mean_over_its_tokens() -> None:
    model, data = tiny_lm(init=0.5), batches(texts(), 8)  # losses that vary by text
    options: dict[str, Any] = dict(precision=Precision("32"), device=torch.device("cpu"),
                                   criterion=nn.CrossEntropyLoss(), metrics=None)
    result = evaluate(model, data, forward=hf_forward, **options)["val/loss"]
    with torch.no_grad():
        logits, labels = hf_forward(model, batches(texts(), 32)[0])
        token_mean = F.cross_entropy(logits, labels).item()
    assert result == pytest.approx(token_mean, rel=1e-5)
    by_batch = evaluate(model, data, forward=lambda m, b: hf_forward(m, b), **options)
    assert abs(by_batch["val/loss"] / token_mean - 1) > 1e-3  # a mean of batch means differs


def test_the_configs_forward_declares_its_count_through_hydras_partial() -> None:
    import functools

    from trainkit.loop.step import targets_counter

    assert targets_counter(functools.partial(hf_forward)) is count_targets  # model=hf's forward
    assert targets_counter(default_forward) is None  # fixed-size targets: by samples
    labels = torch.tensor([[5, 6, -100], [7, 8, 9]])  # a causal LM's: position 0 predicts none
    assert count_targets({"labels": labels}).item() == 3
    assert count_targets({"labels": torch.tensor([1, -100, 2])}).item() == 2  # classes
