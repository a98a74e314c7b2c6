"""Trainer overhead: steps/s of `Trainer.fit` and Lightning's `Trainer.fit` vs a hand-written loop.

    python -m benchmarks.overhead            # ratios of steps per second, loop = 1.0
    python -m benchmarks.overhead --quick
    python -m benchmarks.overhead --mlflow file:/tmp/mlruns   # also trainkit logging to MLflow
    python -m benchmarks.overhead --callback  # also trainkit with one callback that does nothing
    python -m benchmarks.overhead --spike     # also trainkit with trainer.spike on, vs off

All three sides train the same tiny MLP (32-64-10) on the same in-memory batches with the same
SGD (lr 0.01, momentum 0.9) for the same number of steps, fp32 on the CPU with one thread, where
per-step overhead shows most. Each side's time covers its `fit` call (or the bare loop): what a
user waits for; building the model, optimizer and trainer objects is outside the clock for all.

With ``--mlflow``, two more trainkit sides log every 50 steps (the default interval), one with an
``MLflowSink`` (a new MLflow run each fit) and one without, on fits forty times as long (20000
steps, ~3.5 s, so that the sink sends its batched metrics during the fit, every 2 s). Besides
the per-step work, each run starts the sink's MLflow process (~1 s of CPU importing MLflow, on
another core): that cost per run is reported apart, in ms per fit (the difference of the twins'
fit times), and the goal is checked on the fits' second halves. Both twins are timed up to the
summary ``fit`` writes; what ``fit`` then waits for the tracker's last calls (status,
summary.json) and its process's exit is reported apart, in seconds.

Each round runs loop, trainkit, lightning, lightning, trainkit, loop; a ratio is the median over
rounds of the two sides' summed steps/s, so machine noise hits every side alike. Goals: trainkit
>= 0.98 of the loop, and ahead of Lightning.

With ``--spike``, two more trainkit sides feed the same batches through a resumable list (the
guard needs a loader that starts mid-epoch), one with ``trainer.spike`` on at its defaults
(a snapshot every 50 steps, each loss read on the host: free on the CPU), one off.

Lightning is given its lightest ordinary configuration, as a user chasing speed would: no logger,
no checkpoint callback, no progress bar, no model summary, no sanity validation, no validation
batches, ``accelerator="cpu"``, ``devices=1``. (``barebones=True`` measured no different.) Its
batches are fed through a plain iterable, not a DataLoader, exactly like the other two sides.
Without lightning installed (``pip install -e '.[bench]'``) its column is reported as skipped.
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import alternate, emit, median, ratio, row
from trainkit import CheckpointConfig, MLflowSink, Trainer, TrainerConfig
from trainkit.data.loader.resumable import ResumableLoader

Batches = list[tuple[torch.Tensor, torch.Tensor]]
GOAL_VS_LOOP = 0.98
LONG_FITS = 40  # the MLflow twins' fits are this many times --steps


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def make_batches(steps: int, batch: int = 64) -> Batches:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 32, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


class ResumableList(ResumableLoader):
    """The batches as a loader that resumes at any batch (what ``trainer.spike`` needs)."""

    def __init__(self, batches: Batches) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def _pass(self, epoch: int, start: int) -> Any:
        return iter(self.batches[start:])


def with_spike(batches: Batches, *, on: bool) -> float:
    """Steps/s of :func:`with_trainkit` over a :class:`ResumableList`, ``trainer.spike`` on
    or off."""
    return with_trainkit(ResumableList(batches), spike=on)  # type: ignore[arg-type]


def hand_written(batches: Batches) -> float:
    """Steps/s of the loop every PyTorch tutorial writes."""
    model = make_model()
    optimizer = make_optimizer(model)
    start = time.perf_counter()
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return len(batches) / (time.perf_counter() - start)


class NoOp:
    """A callback called every step that does nothing: what dispatching one costs."""

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        pass


class FitClock:
    """Notes when ``fit`` reached step ``half`` and when it wrote its summary. What ``fit`` does
    after the summary is its sinks' close, which waits for a tracker's last calls."""

    def __init__(self, half: int) -> None:
        self.half = half
        self.half_at = self.at = 0.0

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if step == self.half:
            self.half_at = time.perf_counter()

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self.at = time.perf_counter()


def with_trainkit(batches: Batches, *, sinks: tuple[Any, ...] = (),
                  callbacks: tuple[Any, ...] = (), every: int = 100,
                  timings: list[dict[str, float]] | None = None, spike: bool = False) -> float:
    """Steps/s of ``trainkit.Trainer.fit`` with nothing written (no run dir, no checkpoint).

    ``every``: the logging interval. ``timings``: time the fit up to its written summary, and
    append to ``timings`` its steps/s (``whole``), those of its second half (``second_half``)
    and the seconds its sinks' close took after the summary (``close_s``).
    """
    model = make_model()
    optimizer = make_optimizer(model)
    clock = FitClock(len(batches) // 2) if timings is not None else None
    trainer = Trainer(TrainerConfig(device="cpu", max_epochs=1, log_every_n_steps=every,
                                    spike={"enabled": spike}),
                      checkpoint=CheckpointConfig(resume=None, save_last=False),
                      sinks=list(sinks), callbacks=(*callbacks, clock) if clock else callbacks)
    start = time.perf_counter()
    trainer.fit(model, optimizer, batches)
    end = time.perf_counter()
    if clock is None:
        return len(batches) / (end - start)
    timings.append({"whole": len(batches) / (clock.at - start),
                    "second_half": (len(batches) - clock.half) / (clock.at - clock.half_at),
                    "close_s": end - clock.at})
    return timings[-1]["whole"]


def with_mlflow(uri: str, timings: list[dict[str, float]]) -> Callable[[Batches], float]:
    """The MLflow side: a new MLflow run each fit, logging every
    ``TrainerConfig.log_every_n_steps`` (the default, 50), timed to the summary."""
    every = TrainerConfig.log_every_n_steps
    return lambda batches: with_trainkit(batches, sinks=(MLflowSink(uri),), every=every,
                                         timings=timings)


def lightning_side() -> Callable[[Batches], float] | None:
    """A function timing Lightning's ``Trainer.fit``, or None where lightning is not installed."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        return None
    # Lightning's info lines ("GPU available", "fit stopped") and deprecation warnings are noise
    # here, and its stdout lines would land in our JSON output.
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self)

    class Iterable:
        """A sized iterable of batches: Lightning would read a bare list as a list of loaders."""

        def __init__(self, batches: Batches) -> None:
            self.batches = batches

        def __iter__(self) -> Any:
            return iter(self.batches)

        def __len__(self) -> int:
            return len(self.batches)

    def run(batches: Batches) -> float:
        module = Module()
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_epochs=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0,
        )
        data = Iterable(batches)
        start = time.perf_counter()
        trainer.fit(module, data)
        seconds = time.perf_counter() - start
        assert trainer.global_step == len(batches), "Lightning did not take every step"
        return len(batches) / seconds

    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 keeps thread-pool wake-ups out of a tiny model")
    parser.add_argument("--quick", action="store_true", help="a few steps: check it works")
    parser.add_argument("--mlflow", metavar="URI", default=None,
                        help="the trainkit side also logs to this MLflow store (trainkit[mlflow])")
    parser.add_argument("--callback", action="store_true",
                        help="also trainkit with one no-op on_step_end callback")
    parser.add_argument("--spike", action="store_true",
                        help="also trainkit with trainer.spike on, vs off")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 30, 1
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = _measure(args.steps, args.rounds, args.threads, args.mlflow, args.callback,
                          args.spike)
    finally:
        torch.set_num_threads(threads_before)  # `python -m benchmarks` runs others after us
    emit(result)
    return result


def _measure(steps: int, rounds: int, threads: int, mlflow_uri: str | None = None,
             callback: bool = False, spike: bool = False) -> dict[str, Any]:
    batches = make_batches(steps)
    sides: dict[str, Callable[[Batches], float]] = {"loop": hand_written, "trainkit": with_trainkit}
    if callback:
        sides["trainkit+callback"] = functools.partial(with_trainkit, callbacks=(NoOp(),))
    if spike:
        sides["trainkit@resumable"] = functools.partial(with_spike, on=False)
        sides["trainkit+spike"] = functools.partial(with_spike, on=True)
    twins = ("trainkit@50", "trainkit+mlflow")  # on fits LONG_FITS times as long
    timings: dict[str, list[dict[str, float]]] = {name: [] for name in twins}
    if mlflow_uri:
        sides["trainkit@50"] = functools.partial(  # the same without: timed the same way
            with_trainkit, every=TrainerConfig.log_every_n_steps, timings=timings["trainkit@50"])
        sides["trainkit+mlflow"] = with_mlflow(mlflow_uri, timings["trainkit+mlflow"])
    lightning = lightning_side()
    if lightning is not None:
        sides["lightning"] = lightning
    for run in sides.values():  # warm up allocator, kernels and lazy imports on every side
        run(batches[:20])
    for kept in timings.values():
        kept.clear()
    long = batches * LONG_FITS  # the same batches again: no more memory
    samples = alternate({name: (lambda run=run, data=long if name in twins else batches: run(data))
                         for name, run in sides.items()}, rounds)
    result: dict[str, Any] = {
        "benchmark": "overhead",
        "steps_per_s": {name: median(samples, name) for name in samples},
        "ratios": {"trainkit/loop": ratio(samples, "trainkit", "loop")},
        "samples": samples,
        "steps": steps, "rounds": rounds, "threads": threads, "mlflow": mlflow_uri,
        "lightning": "measured" if lightning else "skipped: lightning not installed",
    }
    ratios = result["ratios"]
    rows = [row("overhead: trainkit/loop steps/s", ratios["trainkit/loop"],
                f">= {GOAL_VS_LOOP}", ratios["trainkit/loop"] >= GOAL_VS_LOOP)]
    if callback:
        ratios["trainkit+callback/loop"] = ratio(samples, "trainkit+callback", "loop")
        rows.append(row("overhead: trainkit+no-op callback/loop steps/s",
                        ratios["trainkit+callback/loop"], f">= {GOAL_VS_LOOP}",
                        ratios["trainkit+callback/loop"] >= GOAL_VS_LOOP))
    if spike:
        ratios["trainkit+spike/trainkit"] = ratio(samples, "trainkit+spike", "trainkit@resumable")
        rows.append(row("overhead: trainkit with trainer.spike on/off steps/s",
                        ratios["trainkit+spike/trainkit"], ">= 0.95",
                        ratios["trainkit+spike/trainkit"] >= 0.95))
    if mlflow_uri:
        # per round, as `samples`: each side's two fits
        by_round = {name: [kept[i:i + 2] for i in range(0, len(kept), 2)]
                    for name, kept in timings.items()}
        halves = {name: [[t["second_half"] for t in pair] for pair in pairs]
                  for name, pairs in by_round.items()}
        ratios["trainkit+mlflow/trainkit"] = ratio(halves, "trainkit+mlflow", "trainkit@50")
        ratios["trainkit+mlflow/trainkit, whole fits"] = ratio(samples, "trainkit+mlflow",
                                                               "trainkit@50")
        result["mlflow_ms_per_fit"] = 1000 * statistics.median(
            statistics.mean(len(long) / t["whole"] for t in ml)
            - statistics.mean(len(long) / t["whole"] for t in plain)
            for ml, plain in zip(by_round["trainkit+mlflow"], by_round["trainkit@50"]))
        result["mlflow_close_s"] = statistics.median(
            t["close_s"] for t in timings["trainkit+mlflow"])
        n = len(long)
        rows += [row(f"overhead: trainkit+mlflow/trainkit steps/s (second halves of {n}-step "
                     "fits)",
                     ratios["trainkit+mlflow/trainkit"], f">= {GOAL_VS_LOOP}",
                     ratios["trainkit+mlflow/trainkit"] >= GOAL_VS_LOOP),
                 row(f"overhead: trainkit+mlflow/trainkit steps/s (whole {n}-step fits)",
                     ratios["trainkit+mlflow/trainkit, whole fits"], "(context)", None),
                 row("mlflow: cost per fit (its process started, the run made, metrics sent)",
                     result["mlflow_ms_per_fit"], "(context)", None, unit="ms"),
                 row("mlflow: fit's wait for the tracker at its end", result["mlflow_close_s"],
                     "(context)", None, unit="s")]
    if lightning is not None:
        ratios["lightning/loop"] = ratio(samples, "lightning", "loop")
        ratios["trainkit/lightning"] = ratio(samples, "trainkit", "lightning")
        rows += [row("overhead: lightning/loop steps/s", ratios["lightning/loop"], "(context)",
                     None),
                 row("overhead: trainkit/lightning steps/s", ratios["trainkit/lightning"], "> 1",
                     ratios["trainkit/lightning"] > 1)]
    else:
        rows.append(row("overhead: trainkit/lightning steps/s", None, "> 1", None))
    result["rows"] = rows
    return result


if __name__ == "__main__":
    main()
